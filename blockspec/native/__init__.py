"""blockspec's C kernels for the CPU and their Python face; a leaf: nothing here imports the rest of blockspec.

C (native.h shared): q4gemm.c, q8gemm.c (Q4_1 / Q8_0 x int8 GEMMs), amx.c (AMX tiles), decoder.c (a quantized layer
stack per call), draft.c (a DFlash drafter's context append), layout.c (the shared structs' layout, for the check).
Python: build.py (compile into the user cache; a failed build said once and not retried), lib.py (load, every export
typed), structs.py (the ctypes mirrors, checked against layout.c), q4.py (the weight formats and their matmuls).
What builds these structs from a model is loading/native_stack.py."""
