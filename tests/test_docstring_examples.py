"""The "Examples" blocks of the public API's docstrings run as written and print what they show (doctest)."""

import doctest

import pytest

import diffusers_scalelong

# Each object's own docstring holds an "Examples:" section of `>>>` code on a tiny configuration.
DOCUMENTED = {
    "EDM2Pipeline.__call__": diffusers_scalelong.EDM2Pipeline.__call__,
    "EDMHeunScheduler": diffusers_scalelong.EDMHeunScheduler,
    "PowerFunctionEMA": diffusers_scalelong.PowerFunctionEMA,
    "apply_lsc": diffusers_scalelong.apply_lsc,
    "reconstruct_ema": diffusers_scalelong.reconstruct_ema,
    "EDM2UNet2DModel": diffusers_scalelong.EDM2UNet2DModel,
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_docstring_example_runs(name):
    docstring = DOCUMENTED[name].__doc__
    assert "\n    Examples:\n" in docstring or "\n        Examples:\n" in docstring, f"{name} has no Examples section"
    test = doctest.DocTestParser().get_doctest(docstring, {}, name, None, 0)
    assert len(test.examples) >= 4, f"{name}: the Examples section should show a few steps"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=_fail_with_report)
    assert runner.summarize(verbose=False).failed == 0


def _fail_with_report(report: str) -> None:
    pytest.fail(report, pytrace=False)


def test_a_wrong_expectation_fails():
    """The runner above reports a mismatch (the test can fail)."""
    test = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "wrong", None, 0)
    runner = doctest.DocTestRunner()
    reports = []
    runner.run(test, out=reports.append)
    assert runner.summarize(verbose=False).failed == 1 and "Expected:\n    3" in reports[0]
