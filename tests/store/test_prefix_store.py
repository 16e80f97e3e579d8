"""PrefixStore's own argument: the store it wraps.

Its behaviour as a store is in the conformance suite (``test_store_conformance``).
"""

from __future__ import annotations

import pytest
import torch.distributed as td

from tandem.errors import ArgumentError
from tandem.store import HashStore, PrefixStore


@pytest.mark.parametrize("inner", [object(), "store", None], ids=["object", "str", "none"])
def test_a_prefix_store_over_something_else_than_a_store_is_refused(inner: object) -> None:
    with pytest.raises(ArgumentError, match="PrefixStore takes a tandem store"):
        PrefixStore("job", inner)  # type: ignore[arg-type]


def test_a_torch_store_is_refused_with_what_to_use_instead() -> None:
    # a half-ported script: torch's store inside tandem's PrefixStore
    with pytest.raises(ArgumentError,
                       match=r"got torch\.distributed.s HashStore; make it with tandem\.HashStore"):
        PrefixStore("job", td.HashStore())  # type: ignore[arg-type]


def test_a_prefix_that_is_not_a_str_is_refused() -> None:
    with pytest.raises(ArgumentError, match="prefix must be a str"):
        PrefixStore(b"job", HashStore())  # type: ignore[arg-type]
