"""Pytest hooks, imported by tests/conftest.py, that keep missing tools from hiding behind skip counts.

* At the end of a run, one line per tier (``tests/<tier>/...``, or ``notebooks``) says how many tests it skipped and
  why, reasons grouped and counted. With ``WORKBENCH_SKIP_SUMMARY=FILE`` the lines are also appended to FILE, so that
  tests/run_all.sh can repeat every tier's line at the end.
* A tier named in ``WORKBENCH_REQUIRE_TIERS`` (comma-separated; ``.ci/run`` sets it) whose tools are missing stops
  the run with a usage error that names what is missing and how to install it; elsewhere such a tier skips with the
  same reason. ``workbench.doctor.tier_problems`` answers what is missing, the same answer ``workbench doctor`` gives.
"""
from __future__ import annotations

import collections
import os

import pytest

SUMMARY_ENV = "WORKBENCH_SKIP_SUMMARY"
MAX_REASONS = 4  # per line; the rest are counted as "other reasons"


def tier_of(nodeid: str) -> str:
    """'tests/compile/test_x.py::t' -> 'compile'; 'notebooks/00_tour.ipynb::Cell 3' -> 'notebooks'."""
    parts = nodeid.split("::", 1)[0].replace(os.sep, "/").split("/")
    if parts[0] == "tests" and len(parts) > 2:
        return parts[1]
    return parts[0] if len(parts) > 1 else "."


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def summary_lines(tiers_run, skipped_reports) -> list[str]:
    """One line per tier that ran: '<tier>: N skipped: a × reason; b × reason' (or 'nothing skipped')."""
    by_tier: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for report in skipped_reports:
        by_tier[tier_of(report.nodeid)][skip_reason(report)] += 1
    lines = []
    for tier in sorted(set(tiers_run) | set(by_tier)):
        reasons = by_tier.get(tier)
        if not reasons:
            lines.append(f"{tier}: nothing skipped")
            continue
        top = reasons.most_common(MAX_REASONS)
        text = "; ".join(f"{count} × {reason}" for reason, count in top)
        rest = sum(reasons.values()) - sum(count for _, count in top)
        if rest:
            text += f"; {rest} × {len(reasons) - len(top)} other reason(s)"
        lines.append(f"{tier}: {sum(reasons.values())} skipped: {text}")
    return lines


def pytest_collection_modifyitems(session, config, items):
    from workbench import doctor

    tiers = {tier_of(item.nodeid) for item in items}
    try:
        required = doctor.required_tiers()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    for tier in sorted(required & tiers):
        problems = doctor.tier_problems(tier)
        if problems:
            message = f"{doctor.REQUIRE_ENV} asks for the {tier} tier, but it cannot run here: " + "; ".join(problems)
            _append_summary([f"{tier}: not run: {message}"])
            raise pytest.UsageError(message)
    config._workbench_tiers = tiers


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    lines = summary_lines(getattr(config, "_workbench_tiers", set()), skipped)
    terminalreporter.section("skipped, by tier")
    for line in lines:
        terminalreporter.write_line(line)
    _append_summary(lines)


def _append_summary(lines: list[str]) -> None:
    path = os.environ.get(SUMMARY_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
