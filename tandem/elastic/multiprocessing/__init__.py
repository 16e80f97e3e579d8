"""torch's ``torch.distributed.elastic.multiprocessing`` path, for ported imports: ``errors``."""
