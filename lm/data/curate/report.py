"""The curation report: what came in, what was kept, what each stage dropped and why.

Counts come from the blocks' datatrove stats (see `blocks`). Bytes are the UTF-8
size of a document's text as read, so that `bytes in = kept + dropped` holds even
though C4 line removal and PII redaction edit the kept text (`kept.bytes_out` is the
size actually written).
"""

from __future__ import annotations

from lm.data.curate.settings import DEDUP_STAGES, FILTER_STAGES

STAGES = ("read",) + FILTER_STAGES + DEDUP_STAGES
SHOWN_BAD_RECORDS = 5  # skipped records the table names (report.json lists more)

# Why a document was dropped, for the report and the table (datatrove's reason names).
REASONS = {
    "empty": "no text (empty file, blank text field, or only whitespace)",
    "bad_record": "unreadable record (bad UTF-8, not JSON, no text field), skipped by on_bad_record=skip",
    "language": "language id: best language not in curate.language.keep, or score below the threshold",
    "dup_para_frac": "Gopher repetition: too many duplicated paragraphs",
    "dup_para_char_frac": "Gopher repetition: too many characters in duplicated paragraphs",
    "dup_line_frac": "Gopher repetition: too many duplicated lines",
    "dup_line_char_frac": "Gopher repetition: too many characters in duplicated lines",
    "gopher_short_doc": "Gopher quality: fewer than min_doc_words words",
    "gopher_long_doc": "Gopher quality: more than max_doc_words words",
    "gopher_below_avg_threshold": "Gopher quality: mean word length below min_avg_word_length",
    "gopher_above_avg_threshold": "Gopher quality: mean word length above max_avg_word_length",
    "gopher_too_many_hashes": "Gopher quality: too many '#' per word (comments in code)",
    "gopher_too_many_ellipsis": "Gopher quality: too many ellipses per word",
    "gopher_too_many_bullets": "Gopher quality: too many lines start with a bullet",
    "gopher_too_many_end_ellipsis": "Gopher quality: too many lines end with an ellipsis",
    "gopher_below_alpha_threshold": "Gopher quality: too few words contain a letter",
    "gopher_enough_stop_words": "Gopher quality: fewer than min_stop_words English stop words",
    "curly_bracket": "C4: contains '{' (any code with braces)",
    "lorem_ipsum": "C4: contains 'lorem ipsum'",
    "too_few_sentences": "C4: fewer than min_num_sentences sentences left after dropping lines "
    "without terminal punctuation (most code)",
    "line_punct_ratio": "FineWeb: too few lines end in punctuation (most code)",
    "short_line_ratio": "FineWeb: too many short lines",
    "char_dup_ratio": "FineWeb: too many characters in duplicated lines",
    "list_ratio": "FineWeb: too many newlines per word",
    "word_list": "word list: more than max_hits listed words",
    "exact_duplicate": "exact duplicate of a kept document",
    "near_duplicate": "near duplicate (MinHash/LSH on word 5-grams) of a kept document",
}


def _reason_text(reason: str) -> str:
    if reason.startswith("top_"):
        return "Gopher repetition: the most frequent word n-gram covers too much text"
    if reason.startswith("duplicated_"):
        return "Gopher repetition: duplicated word n-grams cover too much text"
    return REASONS.get(reason, reason)


def _stage(totals: dict) -> dict:
    reasons = {}
    for label, value in totals.items():
        kind, _, reason = label.partition("/")
        if kind in ("drop_docs", "drop_bytes"):
            reasons.setdefault(reason, {"docs": 0, "bytes": 0})[kind[5:]] = int(value)
    return {
        "dropped_docs": sum(r["docs"] for r in reasons.values()),
        "dropped_bytes": sum(r["bytes"] for r in reasons.values()),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]["docs"])),
    }


def build(
    stats: dict,
    cfg,
    inputs: list[str],
    n_files: int,
    skipped_binary: list[str],
    tasks: int,
    seconds: float,
    bad_records: list[str] = (),
) -> dict:
    """The report; `bad_records`: the first records skipped by on_bad_record=skip ("FILE:LINE: problem")."""
    read = stats.get("read", {})
    kept = stats.get("tally:kept", {})
    report = {
        "inputs": inputs,
        "files": n_files,
        "skipped_binary_files": skipped_binary,
        "bad_records": list(bad_records),
        "tasks": tasks,
        "in": {"docs": int(read.get("in_docs", 0)), "bytes": int(read.get("in_bytes", 0))},
        "kept": {
            "docs": int(kept.get("docs", 0)),
            "bytes": int(kept.get("bytes_in", 0)),
            "bytes_out": int(kept.get("bytes_out", 0)),
        },
        "stages": {},
        "redacted": {k.split("/", 1)[1]: int(v) for k, v in stats.get("pii", {}).items() if k.startswith("redacted/")},
        "seconds": round(seconds, 2),
        "config": cfg.to_dict(),
    }
    docs_left = report["in"]["docs"]
    for name in STAGES:
        if name != "read" and not cfg[name].enabled:
            continue
        stage = {"docs_in": docs_left, **_stage(stats.get(name, {}))}
        docs_left -= stage["dropped_docs"]
        report["stages"][name] = stage
    dropped = {k: sum(s[f"dropped_{k}"] for s in report["stages"].values()) for k in ("docs", "bytes")}
    report["dropped"] = dropped
    seen = {r for s in report["stages"].values() for r in s["reasons"]}
    report["reasons_explained"] = {r: _reason_text(r) for r in sorted(seen)}
    for k in ("docs", "bytes"):  # every document is kept or dropped for a reason: a mismatch is a bug
        if report["in"][k] != report["kept"][k] + dropped[k]:
            raise RuntimeError(
                f"curation accounting mismatch in {k}: in {report['in'][k]} != kept "
                f"{report['kept'][k]} + dropped {dropped[k]}"
            )
    report["mb_per_s"] = round(report["in"]["bytes"] / 1e6 / max(seconds, 1e-9), 3)
    return report


def kept_nothing(report: dict) -> str | None:
    """What dropped every document, in a few words (None when some were kept)."""
    if report["kept"]["docs"]:
        return None
    if not report["in"]["docs"]:
        return f"its {report['files']} file(s) hold no documents"
    drops = []
    for name, s in report["stages"].items():
        if s["dropped_docs"]:
            reasons = ", ".join(f"{r} {v['docs']:,}" for r, v in s["reasons"].items())
            drops.append(f"{name} dropped {s['dropped_docs']:,} ({reasons})")
    return f"all {report['in']['docs']:,} were dropped: " + "; ".join(drops)


def _mb(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else f"{n / 1e6:,.2f} MB"


def table(report: dict) -> str:
    """The report as a table for people."""
    rows = [f"{'stage':<18} {'docs in':>9} {'dropped':>9} {'bytes dropped':>14}  reasons"]
    for name, s in report["stages"].items():
        reasons = ", ".join(f"{r} {v['docs']:,}" for r, v in s["reasons"].items()) or "-"
        rows.append(f"{name:<18} {s['docs_in']:>9,} {s['dropped_docs']:>9,} {_mb(s['dropped_bytes']):>14}  {reasons}")
    i, k, d = report["in"], report["kept"], report["dropped"]
    rows.append(
        f"in {i['docs']:,} docs ({_mb(i['bytes'])}) = kept {k['docs']:,} ({_mb(k['bytes'])}, "
        f"{_mb(k['bytes_out'])} written) + dropped {d['docs']:,} ({_mb(d['bytes'])}); "
        f"{report['seconds']:.1f} s, {report['mb_per_s']:.2f} MB/s"
    )
    if report["redacted"]:
        rows.append("redacted: " + ", ".join(f"{n:,} {kind}" for kind, n in report["redacted"].items()))
    bad = report["stages"].get("read", {}).get("reasons", {}).get("bad_record", {}).get("docs", 0)
    if bad:
        listed = report.get("bad_records", [])
        rows.append(
            f"skipped {bad:,} unreadable record(s) (curate.on_bad_record=skip; =error stops at the first)"
            + (f", the first {len(listed)} in report.json:" if len(listed) < bad else ":")
        )
        rows += [f"  {line}" for line in listed[:SHOWN_BAD_RECORDS]]
        if len(listed) > SHOWN_BAD_RECORDS:
            rows.append(f"  ... ({len(listed) - SHOWN_BAD_RECORDS} more in report.json)")
    if report["skipped_binary_files"]:
        rows.append(f"skipped {len(report['skipped_binary_files'])} binary files (listed in report.json)")
    for reason, text in report["reasons_explained"].items():
        rows.append(f"  {reason}: {text}")
    return "\n".join(rows)
