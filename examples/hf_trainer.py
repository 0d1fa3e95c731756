"""Distil a student from a kdcache cache with Hugging Face's Trainer: a compute_loss that calls kdcache.kd_loss.

    python examples/hf_trainer.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20] [--no-shuffle]
                                  [--save-every N] [--resume OUT/checkpoint-N] [--lora-r R]

With --lora-r R the student is the trained model in STUDENT_DIR with LoRA adapters (PEFT): only they train, OUT is
the adapter (PeftModel.from_pretrained(base, OUT)) and OUT/merged the merged model.

Resuming is exact: the Trainer fetches a batch ahead, so the dataset is told which batches were trained
(CacheDataset.mark_trained), its state goes into each checkpoint (kdcache_dataset.json), and the Trainer's own
batch skipping is off (ignore_data_skip): the dataset continues where the trained batches end.
"""
import json
import os

from common import lora_config, parse_args, save_merged, student, to_inputs
from transformers import Trainer, TrainerCallback, TrainingArguments

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
        if model.training and isinstance(self.train_dataset, kdcache.CacheDataset):
            self.train_dataset.mark_trained(inputs["batch"])      # trained, not merely fetched ahead
        return (loss, out) if return_outputs else loss


STATE_FILE = "kdcache_dataset.json"


class SaveDatasetState(TrainerCallback):
    """Writes the dataset's state (what was trained) into each checkpoint the Trainer saves."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
        with open(path, "w") as f:
            json.dump(self.dataset.state_dict(), f)


def training_args(args, **extra):
    saving = dict(save_strategy="steps", save_steps=args.save_every) if args.save_every else dict(save_strategy="no")
    return dict(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                dataloader_num_workers=0, ignore_data_skip=True, **saving, **extra)


def main():
    args = parse_args(__doc__)
    model, tok, vocab = student(args)
    if args.lora_r:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config(args))
        model.print_trainable_parameters()
    dataset = kdcache.CacheDataset(args.cache, shuffle=args.shuffle, seed=0, epochs=None)
    if args.resume:
        with open(os.path.join(args.resume, STATE_FILE)) as f:
            dataset.load_state_dict(json.load(f))
    trainer = KDTrainer(
        model=model, args=TrainingArguments(**training_args(args)), train_dataset=dataset,
        data_collator=lambda records: to_inputs(kdcache.collate(records, pad_id=tok.pad_token_id or 0,
                                                                student_vocab=vocab)),
        callbacks=[SaveDatasetState(dataset)],
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(args.out)                   # a PEFT model: the adapter only
    if args.lora_r:
        save_merged(model, tok, args.out)
    with open(os.path.join(args.out, "kd_losses.json"), "w") as f:
        json.dump(KDTrainer.losses, f)
    print("step losses", KDTrainer.losses)


if __name__ == "__main__":
    main()
