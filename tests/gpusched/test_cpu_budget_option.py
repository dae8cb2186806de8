"""``--cpu-slots``, the CPU budget: a budget of no core is refused in one line naming the option."""

from __future__ import annotations

import pytest
from deadlines import hang_guard

from gpusched.options import UsageError, resolve


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_budget_of_no_core_names_the_option_and_its_source(value):
    with pytest.raises(UsageError, match=rf"^--cpu-slots: '{value}' must be at least 1$"):
        resolve({"cpu_slots": value}, {}, {})
    with pytest.raises(UsageError, match=rf"^GPUSCHED_CPU_SLOTS: '{value}' must be at least 1$"):
        resolve({}, {"GPUSCHED_CPU_SLOTS": value}, {})


@pytest.mark.parametrize("command", ["run", "plan"])
def test_the_command_prints_one_line_and_exits_with_a_usage_error(
    command, make_suite, run_gpusched
):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    result = run_gpusched(command, ".", "--cpu-slots", "0", timeout=hang_guard(30))
    assert result.returncode == 4
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert lines == ["gpusched: error: --cpu-slots: '0' must be at least 1"]
