"""Bytes in and out: storage selected by URL (local, object stores, a local cache in front),
the chunked parallel writer and the verified parallel reader, and their threads."""
