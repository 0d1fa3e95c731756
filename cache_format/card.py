"""`kdcache inspect --card`: a README.md for a cache, so it can be shared or published as a dataset repository.

The card says what the cache holds and how faithfully (teacher, tokenizer, dataset, k, storage), its counts,
and how to load it with kdcache, Hugging Face `datasets` and DuckDB. It is written beside the manifest and is
not part of the format (SPEC.md): readers ignore it.
"""
from .compact import BOUNDS
from .location import as_location
from .manifest import fidelity_text, load_manifest, teacher_ce_text
from .storage import default_codec

CARD = "README.md"


def card_text(m, where):
    meta, parts, c = m.meta, m.fingerprint_parts, m.counts
    tok = meta.get("tokenizer", {})
    shards = [s.path for s in m.shards]
    codec = default_codec(m.backend, parts.get("format", {}).get("codec"))
    short = {k: str(v)[:16] for k, v in (("teacher", parts.get("teacher")), ("data", parts.get("data")),
                                          ("vocab", tok.get("vocab_sha256")))}
    rows = [
        ("teacher", f"{meta.get('teacher', '?')} (weights sha256 {short['teacher']})"),
        ("teacher backend, dtype", f"{meta.get('teacher_backend', '?')}, {meta.get('dtype', '?')}"),
        ("tokenizer", f"{tok.get('vocab_size', '?')} tokens (vocabulary sha256 {short['vocab']})"),
        ("dataset", f"{meta.get('dataset', '?')} (content sha256 {short['data']}), "
                    f"{meta.get('records', '?')} records, skipped: {meta.get('skipped') or 'none'}"),
        ("mode", meta.get("mode", "score")),
        ("top-k", m.top_k),
        ("end-of-turn ids", m.eos_token_ids),
        ("storage", f"{m.backend} shards, codec {codec}"),
        ("log-probs", BOUNDS.get(m.logprob_dtype, m.logprob_dtype) + "; tail mass float32"),
        ("entries per position", f"top-p {m.top_p}, at most {m.top_k}" if m.top_p else
         f"the top {m.top_k} exactly, plus {m.sample} draws from the rest (distinct ids with their counts)"
         if m.sample else m.top_k),
        ("stored fidelity", fidelity_text(m)),
        ("teacher on the data", teacher_ce_text(m)),
        ("samples", f"{c['samples']:,}"),
        ("tokens", f"{c['tokens']:,} ({c['positions']:,} trained positions)"),
        ("size", f"{c['bytes'] / 1e6:.2f} MB ({c['bytes'] / max(c['positions'], 1):.1f} B per trained position)"),
        ("complete", "yes" if m.complete else f"no ({len(shards)} of {m.num_shards_planned} shards)"),
        ("fingerprint", m.fingerprint),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    front = "\n".join(["---", "tags:", "- knowledge-distillation", "- logit-cache", "- kdcache"]
                      + (["configs:", "- config_name: default", "  data_files:"] + [f"  - {p}" for p in shards]
                         if m.backend == "arrow" else []) + ["---"])
    top = f"top-{m.top_k}" if m.top_k else ""
    kind = f"{top + ' + ' if top else ''}{m.sample}-draw sampled" if m.sample else top
    if m.sample:
        exact = f"the teacher's {top} next-token ids with their log-probabilities, and " if top else ""
        rest = "the rest of its" if top else "its"
        what = (f"{exact}{m.sample} draws from {rest} next-token distribution over the full vocabulary (each "
                "drawn id once, with its count and log-probability): an unbiased sample of the whole distribution")
    else:
        what = (f"the teacher's {top} next-token ids and log-probabilities over its full vocabulary, plus the "
                "probability mass outside them")
    return f"""{front}

# Teacher {kind} logit cache (kdcache)

For every sample: the exact token ids the teacher scored (chat template included) and, at every trained
position (each assistant token through its end-of-turn token), {what}. Distil a student
from it without running the teacher: `kdcache train --cache {where} --student STUDENT --out OUT`. The
byte layout is kdcache's cache format, version {m.format_version} (`cache_format/SPEC.md`).

| | |
|---|---|
{table}

## Load it

```python
import kdcache
cache = kdcache.open_cache("{where}")
record = cache[0]       # sample_id, input_ids, positions, topk_ids, topk_logprobs, tail_mass, truncated
```

{_readers(m, where, shards)}
"""


def _readers(m, where, shards):
    if m.backend != "arrow":
        return ("Each shard is a Zarr v3 group: `zarr.open_group(path)` reads its arrays (SPEC.md section 4.2). "
                "Take the shard list from manifest.json: a shard it does not list is not data.")
    return f"""Each shard is an Arrow IPC file. Take the list from manifest.json (a shard it does not list is not data):

```python
import json
shards = ["{where}/" + s["path"] for s in json.load(open("{where}/manifest.json"))["shards"]]
```

```python
import datasets
ds = datasets.load_dataset("arrow", data_files=shards, split="train")
```

```python
import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
{_duckdb_schema(m)}
d = pads.dataset(shards, format="ipc", schema=schema.set(i, f32))
print(duckdb.sql("SELECT count(*), sum(len(positions)) FROM d").fetchall())
```"""


def _duckdb_schema(m):
    """Lines that build `schema`, `i` and `f32`: DuckDB has no float16, so float16 log-probs are read as float32."""
    head = 'schema = pads.dataset(shards, format="ipc").schema      # DuckDB has no float16: read as float32\n'
    if m.format_version == 1:
        return head + """i = schema.get_field_index("topk_logprobs")
k = schema.field(i).type.value_type.list_size
f32 = pa.field("topk_logprobs", pa.list_(pa.list_(pa.float32(), k)))"""
    column = "topk_values"        # format 2: flat per sample, topk_counts entries per position (SPEC.md 4.1)
    kind = "pa.float32()" if m.logprob_dtype != "sqrt8" else "pa.uint8()"
    return head + f'i = schema.get_field_index("{column}")\nf32 = pa.field("{column}", pa.list_({kind}))'


def write_card(where):
    """Write the cache's README.md (atomically); returns its path."""
    loc = as_location(where)
    m = load_manifest(loc)
    loc.write_bytes(CARD, card_text(m, loc.url.rstrip("/")).encode("utf-8"))
    return loc.path(CARD)
