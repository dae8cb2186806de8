import pytest

from gpusched.options import OPTIONS, UsageError, resolve


def test_precedence_cli_over_env_over_pyproject_over_default():
    table = {"timeout": 30, "reruns": 1, "cpu_slots": 3}
    env = {"GPUSCHED_TIMEOUT": "20", "GPUSCHED_RERUNS": "2"}
    values = resolve({"timeout": "10"}, env, table)
    assert values["timeout"] == 10.0
    assert values["reruns"] == 2
    assert values["cpu_slots"] == 3
    assert values["kill_grace"] == 5.0


def test_empty_environment_variable_means_unset():
    assert resolve({}, {"GPUSCHED_TIMEOUT": ""}, {"timeout": 7})["timeout"] == 7.0


@pytest.mark.parametrize(
    ("cli", "env", "table", "source"),
    [
        ({"timeout": "soon"}, {}, {}, "--timeout: 'soon'"),
        ({}, {"GPUSCHED_CPU_SLOTS": "0"}, {}, "GPUSCHED_CPU_SLOTS: '0' must be at least 1"),
        (
            {},
            {},
            {"reruns": -1},
            "[tool.gpusched] reruns in pyproject.toml: -1 must not be negative",
        ),
        ({}, {"GPUSCHED_EXITFIRST": "maybe"}, {}, "GPUSCHED_EXITFIRST: 'maybe' is not a boolean"),
        ({}, {}, {"timout": 3}, "unknown key(s) timout"),
    ],
)
def test_malformed_values_name_their_source(cli, env, table, source):
    with pytest.raises(UsageError) as info:
        resolve(cli, env, table)
    assert source in str(info.value)


def test_every_option_has_help_and_a_gpusched_variable():
    for option in OPTIONS:
        assert option.help and option.env == "GPUSCHED_" + option.name.upper()
