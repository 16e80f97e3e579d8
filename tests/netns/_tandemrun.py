"""``python -m tandem.run`` as a script, for ``NetnsLab.run`` (which runs script files)."""
import runpy

runpy.run_module("tandem.run", run_name="__main__", alter_sys=True)
