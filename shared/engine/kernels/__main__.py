"""``python -m shared.engine.kernels``: build the CPU kernels now."""

from shared.engine.kernels import main

main()
