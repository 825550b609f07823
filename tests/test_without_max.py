"""The numpy reference, the layout and the recorded-case format work where MAX is not
installed: a conformance user needs only numpy and ml_dtypes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import CONFORMANCE_DIR

# Importing `max` (or anything under it) fails in the child, as if MAX were not installed.
BLOCK_MAX = textwrap.dedent("""
    import importlib.abc, sys

    class NoMax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "max" or name.startswith("max."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoMax())
""")


def run_without_max(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_MAX + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120)


def test_reference_layout_and_cases_need_no_max() -> None:
    result = run_without_max(f"""
        import numpy as np
        import gdfold_max
        from gdfold_max import layout, reference
        from gdfold_max.cases import FoldCase, spec_decode_case

        case = FoldCase.load({str(CONFORMANCE_DIR / "public_case_a.npz")!r})
        out = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
        assert np.array_equal(out.view(np.uint32), case.state_out.view(np.uint32))
        made = spec_decode_case(seed=1, layers=2, batch=3, key_dim=16, value_dim=16, ring_len=4)
        again = reference.fold(made.state_in.copy(), made.ring, made.row_ids, made.ring_row_ids, made.num_accepted)
        assert np.array_equal(again.view(np.uint32), made.state_out.view(np.uint32))
        assert layout.RecordLayout(128, 128, 2).min_stride == 416
        from gdfold_max import trees
        trees.check_parents(trees.chain_parents(2, 4), [4, 3], 4)
        assert "max" not in sys.modules and not any(m.startswith("max.") for m in sys.modules)
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_name_that_needs_max_says_so() -> None:
    result = run_without_max("""
        import gdfold_max
        try:
            gdfold_max.fold
        except ModuleNotFoundError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert "No module named 'max" in result.stdout
