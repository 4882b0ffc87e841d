"""The architectures whose transformers code changed before 5.25 refuse an older oracle, naming the version."""

from __future__ import annotations

import pytest

from reference_models import require_transformers


def test_an_older_transformers_fails_the_test_naming_both_versions():
    with pytest.raises(pytest.fail.Exception, match=r"transformers 5\.17\.0 computes gpt-oss .* 'transformers>=5\.25'"):
        require_transformers("5.25", "gpt-oss", installed="5.17.0")
    require_transformers("5.25", "gpt-oss", installed="5.25.0")  # the oracle these tests follow: no failure
    require_transformers("5.25", "gpt-oss")  # the installed one (pyproject's dev extra: >= 5.25)
