"""The plugin under plain pytest: markers, -m selection, skips, globs, bad markers."""

SUITE = {
    "test_mixed.py": """
        import pytest

        def test_cpu():
            pass

        @pytest.mark.gpu(2)
        def test_two():
            pass

        @pytest.mark.gpu1
        def test_one():
            pass

        @pytest.mark.gpu(4, memory="40GB")
        def test_four_big():
            pass
    """,
    "test_module_mark.py": """
        import pytest

        pytestmark = pytest.mark.gpu2

        def test_inherits():
            pass
    """,
}


def selected(output: str) -> set[str]:
    return {
        line.split("::")[1].split()[0]
        for line in output.splitlines()
        if "::" in line and " " in line
    }


def test_mark_expressions_select_by_gpu_count(make_suite, run_pytest):
    make_suite(SUITE)
    gpu2 = run_pytest("-m", "gpu2", "-v")
    assert selected(gpu2.stdout) == {"test_two", "test_inherits"}, gpu2.stdout
    cpu = run_pytest("-m", "not gpu", "-v")
    assert selected(cpu.stdout) == {"test_cpu"}, cpu.stdout
    gpu = run_pytest("-m", "gpu", "-v")
    assert selected(gpu.stdout) == {"test_two", "test_one", "test_four_big", "test_inherits"}


def test_tests_needing_more_gpus_than_visible_are_skipped_with_the_reason(make_suite, run_pytest):
    make_suite(SUITE)
    # Hide every card: on a GPU node some are visible, and this test sets what it counts on.
    none = run_pytest("-rs", CUDA_VISIBLE_DEVICES="")
    assert none.returncode == 0, none.stdout
    assert "needs 2 GPUs, 0 visible" in none.stdout
    assert "1 passed, 4 skipped" in none.stdout
    # Inside a gpusched child on two simulated cards, 1- and 2-GPU tests run.
    two = run_pytest("-rs", GPUSCHED_SIMULATED="1", CUDA_VISIBLE_DEVICES="0,1")
    assert "4 passed, 1 skipped" in two.stdout and "needs 4 GPUs, 2 visible" in two.stdout


def test_bad_markers_are_collection_errors_naming_test_and_problem(make_suite, run_pytest):
    make_suite(
        {
            "test_bad.py": """
            import pytest

            @pytest.mark.gpu(-1)
            def test_negative():
                pass

            @pytest.mark.gpu("two")
            def test_word():
                pass

            @pytest.mark.gpu(1, memory="lots")
            def test_memory():
                pass
        """,
            "test_good.py": "def test_fine():\n    pass\n",
        }
    )
    result = run_pytest()
    assert result.returncode == 2
    assert "ERROR collecting test_bad.py" in result.stdout
    assert "test_bad.py::test_negative: @gpu: GPU count -1 is negative" in result.stdout
    assert "test_bad.py::test_word: @gpu: GPU count 'two' is not an integer" in result.stdout
    assert "test_bad.py::test_memory: memory 'lots' is not a size" in result.stdout


def test_path_globs_from_pyproject_and_markers_win(make_suite, run_pytest):
    make_suite(
        {
            "pyproject.toml": """
            [tool.gpusched.gpus]
            "tests/multi/*" = 2
        """,
            "tests/multi/test_legacy.py": """
            import pytest

            def test_by_glob():
                pass

            @pytest.mark.gpu1
            def test_marker_wins():
                pass
        """,
            "tests/test_plain.py": "def test_cpu():\n    pass\n",
        }
    )
    result = run_pytest("-m", "gpu2", "-v")
    assert selected(result.stdout) == {"test_by_glob"}, result.stdout
    assert selected(run_pytest("-m", "gpu1", "-v").stdout) == {"test_marker_wins"}


def test_bad_glob_value_is_a_usage_error_naming_the_key(make_suite, run_pytest):
    make_suite(
        {
            "pyproject.toml": '[tool.gpusched.gpus]\n"tests/*" = "two"\n',
            "tests/test_x.py": "def test_x():\n    pass\n",
        }
    )
    result = run_pytest()
    assert result.returncode == 4
    assert "[tool.gpusched.gpus] 'tests/*': GPU count 'two' is not an integer" in result.stderr
