"""One-screen summaries printed at the end of ``llmft data prepare`` / ``tokenize``."""

from __future__ import annotations


def prepare_summary(report: dict, output_dir: str) -> str:
    total = report["total_rows"]
    lines = [
        f"prepared {report['source']} -> {output_dir}",
        f"  format      {report['format']}" + _formats_suffix(report) + _columns_suffix(report),
        f"  rows        {total:,} read, {report['accepted']:,} accepted, {report['rejected']:,} rejected "
        f"({report['reject_fraction']:.2%}; limit {report['max_reject_fraction']:.2%})",
        f"  split       train {report['splits']['train']:,} / val {report['splits']['val']:,} "
        f"(val fraction {report['val_fraction']}, seed {report['seed']})",
    ]
    if report["reject_reasons"]:
        reasons = ", ".join(f"{k} {v}" for k, v in report["reject_reasons"].items())
        lines.append(f"  rejects     {reasons}  (details: {output_dir}/rejects.jsonl)")
    lines.append(f"  source sha  {report['source_hash'][:16]}   time {report.get('seconds', 0):.1f} s")
    return "\n".join(lines)


def _columns_suffix(report: dict) -> str:
    columns = report.get("columns") or {}
    return (
        "  (columns " + ", ".join(f"{field} <- {column}" for field, column in columns.items()) + ")" if columns else ""
    )


def _formats_suffix(report: dict) -> str:
    if len(report["formats"]) <= 1:
        return ""
    return "  (" + ", ".join(f"{k} {v}" for k, v in report["formats"].items()) + ")"


def tokenize_summary(manifest: dict, output_dir: str) -> str:
    status = "cache hit, nothing rewritten" if manifest.get("cache_hit") else f"{manifest.get('seconds', 0):.1f} s"
    lines = [
        f"tokenized {manifest['input_dir']} -> {output_dir}  ({status})",
        f"  tokenizer   {manifest['tokenizer']}  (chat template: {manifest['chat_template_source']}, "
        f"end of turn {manifest['end_of_turn']!r})",
        f"  settings    max_length {manifest['max_length']}, packed {manifest['packed']}, "
        f"truncation {manifest['truncation']}",
        f"  {'split':<6} {'rows':>9} {'docs':>9} {'seqs':>8} {'tokens':>12} {'supervised':>12} {'packing':>8} "
        f"{'len p50/p99/max':>17}",
    ]
    for split, s in manifest["splits"].items():
        d = s["doc_length"]
        lines.append(
            f"  {split:<6} {s['rows']:>9,} {s['documents']:>9,} {s['sequences']:>8,} {s['tokens']:>12,} "
            f"{s['supervised_tokens']:>12,} {s['packing_efficiency']:>8.1%} "
            f"{str(d['p50']) + '/' + str(d['p99']) + '/' + str(d['max']):>17}"
        )
        if s["dropped"] or s["truncated"]:
            dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "none"
            first = s["dropped_examples"][0] if s["dropped_examples"] else None
            where = f"; first: {first['file']}:{first['line']} {first['reason']}" if first else ""
            lines.append(f"         dropped: {dropped}; truncated: {s['truncated']}{where}")
    lines.append(f"  cache key   {manifest['cache_key'][:16]}   dataset sha {manifest['dataset_hash'][:16]}")
    return "\n".join(lines)
