"""Write this worker's environment as JSON to <dir>/env_<RANK>.json; print one line."""
import json
import os
import sys

out = sys.argv[1]
with open(os.path.join(out, f"env_{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid(),
               "sys_path0": sys.path[0], "name": __name__}, f)
print(f"stdout of rank {os.environ['RANK']}")
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
