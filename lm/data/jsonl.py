"""The reader of files that are JSONL by contract (metrics, task files): lm.data.records.iter_jsonl,
FILE:LINE errors. Data a user brings (fine-tuning sets, prompts) is read by lm.data.records.iter_records,
which also takes Parquet, Arrow and datasets folders."""

from lm.data.records import ONE_VALUE, iter_jsonl
from lm.data.records import BadRecord as BadLine

ONE_OBJECT = "one JSON object per line"
__all__ = ["ONE_OBJECT", "ONE_VALUE", "BadLine", "iter_jsonl"]
