"""``acshim.install`` checks its arguments before changing anything (issue 8 item 9)."""

from __future__ import annotations


def test_a_bare_dialect_name_is_one_dialect_and_bad_arguments_change_nothing(run_python) -> None:
    result = run_python("""
        import acshim
        meta_path = list(sys.meta_path)
        for kwargs, error, message in [
            (dict(dialects="deepspeedd"), ValueError, "unknown dialect 'deepspeedd'; choose from deepspeed, "),
            (dict(dialects=3), TypeError, "install: dialects must be a dialect name or a list of them"),
            (dict(dialects=["deepspeed", None]), TypeError, "install: dialects must hold dialect names (strings), got None"),
            (dict(hf="yes"), TypeError, "install: hf must be True or False, got 'yes'"),
            (dict(transformers=None), TypeError, "install: transformers must be True or False, got None"),
        ]:
            try:
                acshim.install(**kwargs)
            except error as caught:
                assert str(caught).startswith(message), (kwargs, str(caught))
            else:
                raise AssertionError(f"install({kwargs}) was accepted")
            assert not is_installed() and sys.meta_path == meta_path, kwargs
        installation = acshim.install(dialects="deepspeed", transformers=False)
        print(sorted(installation.reports))
        uninstall()
        assert not is_installed()
    """)
    assert result.stdout.split("\n")[-2] == "['deepspeed']"
