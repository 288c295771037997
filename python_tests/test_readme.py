"""The README's Python example runs as written."""

import pathlib
import re
import warnings

import kivi_fast


def test_readme_example_runs():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", kivi_fast.ClippingWarning)  # the example is a well-posed fit
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["kl"].shape == () and namespace["post"].grad is not None
    assert namespace["kl_b"].shape == (32,)
