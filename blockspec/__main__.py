import os
import sys

from blockspec.cli import main

code = main()
if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
    # a torch.distributed rank (torchrun) that has left its process groups and said everything: skip the interpreter's
    # teardown, where gloo's and the rendezvous store's threads can still abort a finished rank (exit -6, "terminate
    # called without an active exception") when its peer exits at the same moment
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
