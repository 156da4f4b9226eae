"""Run several ``ckpt-tools`` commands, one after the other, in each rank of a torchrun job (tests/test_distributed.py).

argv[1]: a JSON list of command lines; argv[2]: a directory where each rank writes ``rank_{r}.json`` with the
exit code of every command. One torchrun start (and one torch import per rank) serves every direction."""
import json
import os
import sys

from ckpt_tools.cli import main

if __name__ == "__main__":
    cmds, out = json.loads(sys.argv[1]), sys.argv[2]
    codes = [main(c) for c in cmds]
    with open(os.path.join(out, f"rank_{os.environ['RANK']}.json"), "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "codes": codes}, f)
