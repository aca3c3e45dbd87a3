"""`callbacks/stats_logs.py`: the `offload/...` entries of the Trainer's logs; the console gets the headline ones,
the run's history all of them."""

import re

import transformers
from helpers import COMMON_ARGS, CPU_TEST_MODE, tiny_model

from hf_offload import TrainingArguments
from hf_offload.callbacks.stats_logs import HEADLINE_KEYS, log_entries


def test_the_console_gets_the_headlines_and_the_history_gets_everything(tmp_path, tokenizer, lm_dataset, capsys):
    args = TrainingArguments(str(tmp_path), activation_offloading=True, **{**COMMON_ARGS, "eval_strategy": "no"},
                             **CPU_TEST_MODE)  # fmt: skip
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=tiny_model(tokenizer), args=args, train_dataset=lm_dataset,
                                   data_collator=collator)  # fmt: skip
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == COMMON_ARGS["max_steps"]
    for line in printed:  # PrinterCallback prints each log as a dict
        assert sorted(re.findall(r"'(offload/[^']+)'", line)) == sorted(HEADLINE_KEYS[:2])  # no peak in CPU test mode
    history = [record for record in trainer.state.log_history if "loss" in record]
    assert all({"offload/bytes_offloaded", "offload/steps", *HEADLINE_KEYS[:2]} <= record.keys() for record in history)


def test_the_console_shows_a_few_kib_offloaded_per_step_as_more_than_zero():
    # A tiny model offloads 28-52 KiB per step; the console prints each float with 4 significant digits.
    stats = {"steps": 2, "bytes_offloaded": 2 * 28 * 2**10, "compute_wait_s": 0.0}
    shown = f"{log_entries(stats)[HEADLINE_KEYS[0]]:.4g}"
    assert shown == "0.02734" and HEADLINE_KEYS[0].endswith("_mib_per_step")


def test_the_pools_growth_is_logged_only_in_the_intervals_that_grew_it():
    stats = {"steps": 1, "bytes_offloaded": 2**20, "compute_wait_s": 0.0, "pool_grown_bytes": 0, "pool_growth_s": 0.0}
    assert not {"offload/pool_grown_bytes", "offload/pool_growth_s"} & log_entries(stats).keys()
    grew = log_entries({**stats, "pool_grown_bytes": 2**20, "pool_growth_s": 0.25})
    assert grew["offload/pool_grown_bytes"] == 2**20 and grew["offload/pool_growth_s"] == 0.25
