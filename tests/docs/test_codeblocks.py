"""``tests/docs/codeblocks.py``: the block finder and the output comparison the docs' tests rely on."""

from __future__ import annotations

import textwrap

from . import codeblocks as cb


def page(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text))
    return cb.blocks(path)


def test_markers_classify_blocks(tmp_path):
    found = page(tmp_path, """\
        # A page

        ```python
        print(1)
        ```

        <!-- docs: output -->
        ```
        1
        ```

        <!-- docs: skip gpu: needs 8 GPUs -->
        ```bash
        polyparallel launch --nproc-per-node 8 train.py
        ```

        !!! note
            <!-- docs: run timeout=30 -->
            ```bash
            polyparallel plan --world 2
            ```

        ```bash
        echo unmarked
        ```

        <!-- docs: skip someday: later -->
        ```python
        pass
        ```
        """)
    assert [(b.kind, b.lang) for b in found] == [("run", "python"), ("output", ""), ("skip", "bash"), ("run", "bash"),
                                                ("unmarked", "bash"), ("skip", "python")]
    assert found[2].options == {"category": "gpu", "why": "needs 8 GPUs"} and found[2].problem is None
    assert found[3].options == {"timeout": "30"} and found[3].code == "polyparallel plan --world 2\n"
    assert "without a marker" in found[4].problem
    assert "needs a category of" in found[5].problem


def test_a_block_may_hold_longer_fences_and_snippets(tmp_path):
    (tmp_path / "inc.py").write_text("x = 1\n")
    found = page(tmp_path, f"""\
        <!-- docs: skip not-code: shows a fence -->
        ````markdown
        ```python
        inner
        ```
        ````

        ```python
        --8<-- "{tmp_path / 'inc.py'}"
        print(x)
        ```
        """)
    assert len(found) == 2 and "inner" in found[0].code
    assert found[1].code == "x = 1\nprint(x)\n"


def test_output_comparison():
    assert cb.output_matches("loss 0.0793\n", "loss 0.0794\n")  # within 2%
    assert not cb.output_matches("loss 0.0793\n", "loss 0.0893\n")
    assert cb.output_matches("a   b\n...\nend\n", "a b\nx\ny\nend\n")
    assert cb.output_matches("a\n...\nend", "a\nend")
    assert cb.output_matches("took ... ms", "took 3.2 ms")
    assert not cb.output_matches("a\nb", "a\nb\nc")
    assert not cb.output_matches("rank 2", "rank 3")  # integers match exactly
