"""Distil a student from a kdcache cache with Hugging Face's Trainer: a compute_loss that calls kdcache.kd_loss.

    python examples/hf_trainer.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20] [--no-shuffle]
"""
import json
import os

from common import fresh_student, parse_args, to_inputs
from transformers import Trainer, TrainingArguments

import kdcache


class KDTrainer(Trainer):
    """inputs["batch"] is a kdcache.Batch; the loss is the cached teacher against the student's own logits."""

    losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = inputs["batch"].to(model.device)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids)
        loss = kdcache.kd_loss(out.logits, batch, beta=0.0)
        self.losses.append(loss.item())
        return (loss, out) if return_outputs else loss


def training_args(args, **extra):
    return dict(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, dataloader_num_workers=0, **extra)


def main():
    args = parse_args(__doc__)
    model, tok, vocab = fresh_student(args.student)
    trainer = KDTrainer(
        model=model, args=TrainingArguments(**training_args(args)),
        train_dataset=kdcache.CacheDataset(args.cache, shuffle=args.shuffle, seed=0, epochs=None),
        data_collator=lambda records: to_inputs(kdcache.collate(records, pad_id=tok.pad_token_id or 0,
                                                                student_vocab=vocab)),
    )
    trainer.train()
    trainer.save_model(args.out)
    with open(os.path.join(args.out, "kd_losses.json"), "w") as f:
        json.dump(KDTrainer.losses, f)
    print("step losses", KDTrainer.losses)


if __name__ == "__main__":
    main()
