"""Helpers below everything else: errors, atomic file writes, typed configs, signals, batching, model heads.

The import graph runs one way: kdcache.common -> kdcache.cache_format -> kdcache.pipeline | kdcache.train
(side by side, neither imports the other) -> the public API, the CLI and the demo (kdcache, kdcache.cli,
kdcache.demo). Nothing here imports the floors above.
"""
