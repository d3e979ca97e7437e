"""The snapshot format, pure: the manifest and its encoding, the marker, checksums, plain-value
encoding, compression, region geometry and object layout. No I/O, no torch.distributed.

Imports only :mod:`trainsnap.errors`. Internal: the format itself is specified in FORMAT.md.
"""
