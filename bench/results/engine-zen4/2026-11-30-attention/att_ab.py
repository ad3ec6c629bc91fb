import sys, runpy
sys.path.insert(0, "/work/main")
from shared.engine import kernels
tag, variant = sys.argv[1], sys.argv[2]
kernels.BUILDS[tag + "b"] = kernels.BUILDS[tag]
main_source = kernels.SOURCE
kernels.SOURCE = __import__("pathlib").Path(variant); kernels.source_digest.cache_clear()
assert kernels.load(tag + "b") is None
kernels.SOURCE = main_source; kernels.source_digest.cache_clear()
sys.argv = ["att.py", f"{tag},{tag}b", *sys.argv[3:]]
runpy.run_path("/tmp/mb/att.py", run_name="__main__")
