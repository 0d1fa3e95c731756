"""Distil a student from a kdcache cache with TRL's SFTTrainer: its own data preparation is skipped (the cache
holds the exact token ids), and compute_loss calls kdcache.kd_loss.

    python examples/trl_sft.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20] [--no-shuffle]
"""
import argparse
import json
import os

import datasets
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import kdcache


class KDSFTTrainer(SFTTrainer):
    losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = inputs["batch"].to(model.device)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids)
        loss = kdcache.kd_loss(out.logits, batch, beta=0.0)
        self.losses.append(loss.item())
        return (loss, out) if return_outputs else loss


FIELDS = ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass", "truncated")


def rows(cache, shuffle):
    """The cache's records as plain rows: SFTTrainer takes only a `datasets` Dataset or IterableDataset."""
    for record in kdcache.CacheDataset(cache, shuffle=shuffle, seed=0, epochs=None):
        yield {name: getattr(record, name) for name in FIELDS}


def to_record(row):
    return kdcache.Record(**{k: v if k in ("sample_id", "truncated") else np.asarray(v) for k, v in row.items()})


def to_inputs(batch):
    """What the Trainer sees: input_ids (Accelerate sizes and shards batches by their first tensor; tensors of
    another length, like the N trained positions, would be cut) and the whole kdcache.Batch as one object."""
    return {"input_ids": batch.input_ids, "batch": batch}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    args = p.parse_args()

    tok = AutoTokenizer.from_pretrained(args.student)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.student), dtype=torch.float32)
    vocab = model.get_input_embeddings().weight.shape[0]
    config = SFTConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                       learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                       report_to=[], use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False,
                       dataset_kwargs={"skip_prepare_dataset": True})
    trainer = KDSFTTrainer(
        model=model, args=config, processing_class=tok,
        train_dataset=datasets.IterableDataset.from_generator(rows, gen_kwargs={"cache": args.cache,
                                                                                "shuffle": args.shuffle}),
        data_collator=lambda batch: to_inputs(kdcache.collate([to_record(r) for r in batch],
                                                              pad_id=tok.pad_token_id or 0, student_vocab=vocab)),
    )
    trainer.train()
    trainer.save_model(args.out)
    with open(os.path.join(args.out, "kd_losses.json"), "w") as f:
        json.dump(KDSFTTrainer.losses, f)
    print("step losses", KDSFTTrainer.losses)


if __name__ == "__main__":
    main()
