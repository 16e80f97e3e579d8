"""The flags of ``examples/train_chars.py``, parsed and checked without importing torch.

``scripts/train.sh`` runs this file first, so a mistyped flag or ``--help`` is answered at
once, before any worker starts::

    python examples/train_chars/cli.py --quick --steps 5   # exit 0: the flags are good
    python examples/train_chars/cli.py --help              # the help, then exit 3
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from typing import Any, NoReturn, Sequence

DESCRIPTION = ("Train a character-level transformer on Python's standard library with "
               "tandem DDP.")
SYNC_METHODS = ("ddp", "local-sgd", "diloco")
DEFAULT_INNER_STEPS = 20
DEFAULT_OUTER_LR = 0.7  # the DiLoCo paper's outer SGD (Douillard et al. 2023)
DEFAULT_OUTER_MOMENTUM = 0.9
HELP_SHOWN = 3  # exit status of a check that printed the help: the caller stops, no error

FULL = {"steps": 300, "batch_size": 16, "seq_len": 128, "dim": 128, "layers": 3, "heads": 4,
        "corpus_mb": 3.0, "eval_windows": 512, "sample_chars": 300}
QUICK = {"steps": 30, "batch_size": 8, "seq_len": 64, "dim": 64, "layers": 2, "heads": 4,
         "corpus_mb": 0.5, "eval_windows": 64, "sample_chars": 120}


EPILOG = """\
processes:
  standalone (python examples/train_chars.py): --nproc N local ranks (default 2).
  scripts/train.sh: --nproc N, or NPROC=N (default 2), becomes tandemrun's
  --nproc-per-node. Under any launcher the launcher sets the ranks (WORLD_SIZE),
  and a --nproc given to this script is refused: give it to the launcher.
outputs:
  each run writes checkpoint.pt, loss.png and metrics.json to a new directory,
  runs/train_chars/run_NNN; --out DIR writes to DIR instead, and never over another
  run's checkpoint. --resume continues the latest run (or DIR's checkpoint).
synchronisation (--sync):
  ddp        average the gradients every step (DistributedDataParallel): the default.
  local-sgd  each rank steps alone; every --inner-steps H steps the ranks average their
             parameters (PostLocalSGDOptimizer with a PeriodicModelAverager).
  diloco     each rank runs H AdamW steps alone, then the ranks average the change since
             the last sync and an outer SGD (Nesterov momentum) applies it (DiLoCo);
             --fragments N syncs the model in N parts in turn (streaming DiLoCo).
  Across slow links local-sgd and diloco talk H times less often than ddp:
  python -m tandem.bench slow-links compares them.
time:
  the default 300 steps train in about 65 s on 2 idle CPU cores, and in up to 4
  minutes while other jobs load them (load 5-7); --quick takes 15-35 s, mostly
  starting the processes. The first set-up adds 1-3 minutes.
"""


class _Parser(argparse.ArgumentParser):
    """Under a launcher every rank parses the same command line and finds the same
    error (or ``--help``): rank 0 alone prints it. The launcher would merge the ranks'
    copies only when they arrive within a second of each other, and ranks that start
    further apart than that on a loaded machine would each print theirs."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        """Name the flag a mistyped one was probably meant to be."""
        flags = [f for a in self._actions for f in a.option_strings if f.startswith("--")]
        unknown = message.split("unrecognized arguments:")[1:]
        for word in (unknown[0].split() if unknown else []):
            close = difflib.get_close_matches(word.split("=")[0], flags, n=1)
            if word.startswith("--") and word not in flags and close:
                message += f" (did you mean {close[0]}?)"
                break
        super().error(message)


def parse(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], argparse.Namespace]:
    """The run's settings (``RunConfig``'s fields) and the parsed flags; exits 2 on a bad
    flag or value, naming it (a prefix of a flag is not taken for it)."""
    p = _Parser(prog="train_chars.py", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--steps", type=int, help="total optimizer steps (default 300; quick 30)")
    p.add_argument("--batch-size", type=int, help="sequences per rank per step (16; quick 8)")
    p.add_argument("--seq-len", type=int, help="characters per sequence (128; quick 64)")
    p.add_argument("--dim", type=int, help="model width (128; quick 64)")
    p.add_argument("--layers", type=int, help="transformer blocks (3; quick 2)")
    p.add_argument("--corpus-mb", type=float, help="MB of stdlib source to read (3; quick 0.5)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="ranks of a standalone run (2); see 'processes' below")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--out", metavar="DIR",
                   help="this run's directory (default: a new runs/train_chars/run_NNN)")
    p.add_argument("--resume", action="store_true",
                   help="continue the latest run, or --out's (automatic after a launcher "
                        "restart)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint period in steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a ~15 s smoke run: 30 small steps")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state over the ranks (ZeroRedundancyOptimizer)")
    p.add_argument("--shard-grads", action="store_true",
                   help="also keep only each rank's shard of the gradients (implies --zero)")
    p.add_argument("--uneven", type=int, default=0, metavar="N",
                   help="rank r trains N x r steps fewer; Join lets the others finish (0: off)")
    p.add_argument("--elastic", action="store_true",
                   help="survive a lost rank in place (tandem.elastic; under tandemrun, e.g. "
                        "scripts/train.sh --elastic)")
    p.add_argument("--sync", choices=SYNC_METHODS, default="ddp",
                   help="how the ranks keep their models together (default ddp); see "
                        "'synchronisation' below")
    p.add_argument("--inner-steps", type=int, metavar="H",
                   help=f"local-sgd and diloco: local steps between syncs "
                        f"(default {DEFAULT_INNER_STEPS})")
    p.add_argument("--fragments", type=int, metavar="N",
                   help="diloco: sync the model in N fragments in turn, each overlapped with "
                        "the next steps (streaming DiLoCo; default 1)")
    p.add_argument("--outer-lr", type=float, metavar="LR",
                   help=f"diloco: the outer SGD's learning rate (default {DEFAULT_OUTER_LR})")
    p.add_argument("--outer-momentum", type=float, metavar="M",
                   help=f"diloco: the outer SGD's Nesterov momentum, 0 for none "
                        f"(default {DEFAULT_OUTER_MOMENTUM})")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="also evaluate every N steps; metrics.json's val_curve gets "
                        "(step, training seconds, loss) for each (0: at the end only)")
    ns = p.parse_args(argv)
    preset = QUICK if ns.quick else FULL
    cfg: dict[str, Any] = {k: (getattr(ns, k) if getattr(ns, k, None) is not None else v)
                           for k, v in preset.items()}
    cfg.update(lr=ns.lr, out=ns.out, resume=ns.resume, seed=ns.seed, save_every=ns.save_every,
               zero=ns.zero or ns.shard_grads, shard_grads=ns.shard_grads, uneven=ns.uneven,
               elastic=ns.elastic)
    for name in ("steps", "batch_size", "seq_len", "dim", "layers", "eval_windows",
                 "corpus_mb", "lr"):
        if not 0 < cfg[name] < math.inf:  # NaN too
            p.error(f"--{name.replace('_', '-')} must be positive")
    if cfg["dim"] % cfg["heads"]:
        p.error(f"--dim must be a multiple of {cfg['heads']} (attention heads)")
    if (ns.nproc is not None and ns.nproc <= 0) or ns.threads <= 0:
        p.error("--nproc and --threads must be positive")
    world = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
    # even a --nproc equal to WORLD_SIZE is refused: accepting it would let a user
    # believe this flag sets the ranks under a launcher, until the day it differs
    if world is not None and ns.nproc is not None:
        p.error(f"--nproc {ns.nproc}: a launcher started this run with {world} ranks "
                f"(WORLD_SIZE); --nproc only sets the ranks of a standalone run. Give the "
                f"launcher the number instead (scripts/train.sh --nproc N, tandemrun "
                f"--nproc-per-node N)")
    if ns.uneven < 0:
        p.error("--uneven must be 0 (off) or positive")
    if ns.elastic and (cfg["zero"] or cfg["uneven"]):
        p.error("--elastic needs every rank to hold the whole optimizer state and train every "
                "step: drop --zero, --shard-grads and --uneven")
    _check_sync(p, ns, cfg)
    return cfg, ns


def _check_sync(p: _Parser, ns: argparse.Namespace, cfg: dict[str, Any]) -> None:
    """Fill in and check --sync, --inner-steps, --fragments and --eval-every."""
    if ns.eval_every < 0:
        p.error(f"--eval-every {ns.eval_every}: use 0 (at the end only) or a number of steps")
    cfg.update(sync=ns.sync, inner_steps=1, fragments=1, eval_every=ns.eval_every,
               outer_lr=DEFAULT_OUTER_LR, outer_momentum=DEFAULT_OUTER_MOMENTUM)
    for flag, value in (("--outer-lr", ns.outer_lr), ("--outer-momentum", ns.outer_momentum)):
        if value is not None and ns.sync != "diloco":
            p.error(f"{flag} {value}: only --sync diloco has an outer optimizer")
    if ns.outer_lr is not None and not 0 < ns.outer_lr <= 10:
        p.error(f"--outer-lr {ns.outer_lr}: must be above 0 and at most 10 (1 with "
                f"--outer-momentum 0 is plain parameter averaging)")
    if ns.outer_momentum is not None and not 0 <= ns.outer_momentum < 1:
        p.error(f"--outer-momentum {ns.outer_momentum}: must be at least 0 and below 1")
    if ns.sync == "ddp":
        for flag, value in (("--inner-steps", ns.inner_steps), ("--fragments", ns.fragments)):
            if value is not None:
                p.error(f"{flag} {value}: --sync ddp averages gradients every step; "
                        f"{flag} needs --sync local-sgd or diloco")
        return
    inner = DEFAULT_INNER_STEPS if ns.inner_steps is None else ns.inner_steps
    if not 1 <= inner <= cfg["steps"]:
        p.error(f"--inner-steps {inner}: must be between 1 and --steps ({cfg['steps']})")
    if ns.fragments is not None and ns.sync != "diloco":
        p.error(f"--fragments {ns.fragments}: only --sync diloco syncs the model in "
                f"fragments")
    fragments = 1 if ns.fragments is None else ns.fragments
    if not 1 <= fragments <= inner:
        p.error(f"--fragments {fragments}: must be between 1 and --inner-steps ({inner}): "
                f"each fragment syncs once every --inner-steps steps, at its own step")
    if cfg["zero"] or cfg["uneven"] or cfg["elastic"]:
        p.error(f"--sync {ns.sync} keeps a whole model and optimizer on every rank and "
                f"syncs every rank at the same steps: drop --zero, --shard-grads, --uneven "
                f"and --elastic (they go with --sync ddp)")
    cfg.update(inner_steps=inner, fragments=fragments)
    if ns.outer_lr is not None:
        cfg.update(outer_lr=ns.outer_lr)
    if ns.outer_momentum is not None:
        cfg.update(outer_momentum=ns.outer_momentum)


if __name__ == "__main__":
    try:
        parse(sys.argv[1:])
    except SystemExit as end:  # argparse ends with 0 only after printing the help
        sys.exit(HELP_SHOWN if end.code == 0 else end.code)
