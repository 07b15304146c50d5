import os

# The kernels run on the CPU through Triton's interpreter when no GPU is present; this must be set
# before triton is imported anywhere.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
