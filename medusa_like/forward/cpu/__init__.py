"""This project's CPU kernels: the few-row linear layers an eager step runs (`few_row_linear.py` over the fp32 and bf16
kernels), row-invariant tree attention, the C++ builds, and training's many-row read. The decoding core never names a
kernel; a cost model records which layers it was measured on."""
