"""``python -m shared.kernels``: build the CPU kernels now."""

from shared.kernels import main

main()
