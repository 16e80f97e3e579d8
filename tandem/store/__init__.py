"""Key-value stores for rendezvous: TCPStore, FileStore, HashStore, PrefixStore."""

from tandem.store.base import Store
from tandem.store.file import FileStore
from tandem.store.hash import HashStore
from tandem.store.prefix import PrefixStore
from tandem.store.tcp import TCPStore

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore"]
