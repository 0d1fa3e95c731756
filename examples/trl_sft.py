"""Distil a student from a kdcache cache with TRL's SFTTrainer: its data preparation is skipped (the cache holds
the exact token ids) and compute_loss is hf_trainer.py's.

    python examples/trl_sft.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20] [--no-shuffle] [--lora-r R]

With --lora-r R, SFTTrainer's own peft_config puts LoRA adapters on the trained model in STUDENT_DIR: only they
train, OUT is the adapter and OUT/merged the merged model.
"""
import json
import os

import datasets
import numpy as np
from common import lora_config, parse_args, save_merged, student, to_inputs
from hf_trainer import KDTrainer, training_args
from trl import SFTConfig, SFTTrainer

import kdcache

FIELDS = ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass", "truncated",
          "target_logprobs")


class KDSFTTrainer(SFTTrainer):
    compute_loss = KDTrainer.compute_loss
    losses = KDTrainer.losses


def rows(cache, shuffle):
    """The cache's records as plain rows: SFTTrainer takes only a `datasets` Dataset or IterableDataset."""
    for record in kdcache.CacheDataset(cache, shuffle=shuffle, seed=0, epochs=None):
        yield {name: getattr(record, name) for name in FIELDS}


def to_record(row):
    return kdcache.Record(**{k: v if k in ("sample_id", "truncated") or v is None else np.asarray(v)
                             for k, v in row.items()})


def main():
    args = parse_args(__doc__)
    model, tok, vocab = student(args)
    trainer = KDSFTTrainer(
        model=model, processing_class=tok, peft_config=lora_config(args),
        args=SFTConfig(**training_args(args, remove_unused_columns=False,
                                       dataset_kwargs={"skip_prepare_dataset": True})),
        train_dataset=datasets.IterableDataset.from_generator(rows, gen_kwargs={"cache": args.cache,
                                                                                "shuffle": args.shuffle}),
        data_collator=lambda batch: to_inputs(kdcache.collate([to_record(r) for r in batch],
                                                              pad_id=tok.pad_token_id or 0, student_vocab=vocab)),
    )
    trainer.train()
    trainer.save_model(args.out)                   # a PEFT model: the adapter only
    if args.lora_r:
        save_merged(trainer.model, tok, args.out)
    with open(os.path.join(args.out, "kd_losses.json"), "w") as f:
        json.dump(KDSFTTrainer.losses, f)
    print("step losses", KDSFTTrainer.losses)


if __name__ == "__main__":
    main()
