"""Print a new job secret: ``export TANDEM_SECRET=$(python -m tandem.secret)``.

A multi-node job needs one secret that every node shares (see
:func:`tandem.config.load_secret`); a batch script makes it once, before ``srun``,
and every task inherits it. 32 random bytes, as 64 hex digits.
"""

from __future__ import annotations

import secrets

__all__ = ["new_secret"]


def new_secret() -> str:
    """A fresh secret: 64 hex digits from the OS's random source."""
    return secrets.token_hex(32)


if __name__ == "__main__":
    print(new_secret())
