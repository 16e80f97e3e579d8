"""The rank given as argv[1] raises ValueError; the others wait to be stopped.
With argv[2] == "record", main() is wrapped in torch's @record, at tandem's path."""
import os
import sys
import time

def load_batch(rank: str) -> None:
    raise ValueError(f"bad batch on rank {rank}")


def main() -> None:
    if os.environ["RANK"] == sys.argv[1]:
        time.sleep(0.2)
        load_batch(os.environ["RANK"])
    time.sleep(60)


if sys.argv[2:] == ["record"]:
    from tandem.elastic.multiprocessing.errors import record

    main = record(main)
main()
