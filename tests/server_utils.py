"""Shared by the server tests: a tiny HF checkpoint with a character-level tokenizer and chat template, a random
DFlash drafter for it, and a real uvicorn server on a loopback port in a background thread."""

from __future__ import annotations

import atexit
import functools
import shutil
import socket
import string
import tempfile
import threading
import time
from pathlib import Path

from blockspec.config import SpeculativeConfig
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

VOCAB = 128
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1 (bos), 2 (eos, as in hf_utils' config)
# one character per token, every id < VOCAB decodes to text: the 100 printable ASCII characters and some others
CHARS = list(dict.fromkeys(string.printable)) + list("éàüßøñç€→中文日本語привет") + list("ΩΣλμπ")
assert len(SPECIAL) + len(CHARS) == VOCAB
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_char_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(str(path))


def make_checkpoints(root: Path) -> tuple[Path, Path]:
    """A tiny llama target with the character tokenizer and a random 1-layer DFlash drafter (block 4, K = 3)."""
    hf = make_hf_model("llama", seed=0, initializer_range=0.3)  # wide logits: varied greedy text, no near-ties
    target = save_hf_model(hf, root / "target")
    save_char_tokenizer(target)
    make_zlab_draft(hf.config, root / "draft", layers=1, block_size=4, target_layer_ids=(0, 1),
                    mask_token_id=VOCAB - 1)
    return target, root / "draft"


@functools.lru_cache(maxsize=None)
def tiny_pair():
    """(checkpoint dir, draft dir, loaded target, loaded drafter), built once per test process; do not modify."""
    root = Path(tempfile.mkdtemp(prefix="blockspec-server-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    target, draft = make_checkpoints(root)
    lm = load_model(str(target), LoadConfig(device="cpu"))
    return target, draft, lm, load_draft(SpeculativeConfig(draft_model=str(draft)), lm)


class LiveServer:
    """build_app(engine) served by uvicorn on 127.0.0.1:<free port> in a thread, until stop()."""

    def __init__(self, engine, name: str = "tiny", api_key: str | None = None, **app_options) -> None:
        import uvicorn

        from blockspec.server.app import build_app

        self.engine = engine
        self.app = build_app(engine, name, api_key, **app_options)
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                                  **kw)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine has no request left (aborts land a step after the disconnect)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() or self.engine.seqs:
            assert time.monotonic() < deadline, "the engine still has requests"
            time.sleep(0.02)

    def stop(self) -> None:
        self.app.state.engine_loop.begin_shutdown()
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
