"""install() / uninstall(): facades served under absent upstream names, installed upstream packages
patched in place (and only their entry points), exact restoration, idempotence, rollback.

Every test runs its patching in a fresh interpreter (``run_python``): import hooks and
``sys.modules`` entries are process-wide."""

from __future__ import annotations

from pathlib import Path


def test_absent_package_resolves_to_the_same_facade_module_objects(fake_packages: Path, run_python) -> None:
    run_python("""
        meta_path = list(sys.meta_path)
        install(dialects=[GHOST], transformers=False)
        import ghostpkg, ghostpkg.core
        from ghostpkg.sub import mod
        import fakefacade, fakefacade.core, fakefacade.sub.mod
        assert ghostpkg is fakefacade and ghostpkg.core is fakefacade.core and mod is fakefacade.sub.mod
        import ghostpkg.sub.mod
        assert sys.modules["ghostpkg.sub.mod"] is fakefacade.sub.mod
        assert mod.__spec__.name == "fakefacade.sub.mod", "the facade keeps describing itself"
        try:
            import ghostpkg.not_in_facade
        except ModuleNotFoundError as error:
            assert error.name == "ghostpkg.not_in_facade", error
        else:
            raise AssertionError("a name the facade lacks must not import")
        uninstall()
        assert sys.meta_path == meta_path
        assert not [m for m in sys.modules if m == "ghostpkg" or m.startswith("ghostpkg.")]
        try:
            import ghostpkg  # noqa: F811
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("ghostpkg still imports after uninstall")
        assert sys.modules["fakefacade.sub.mod"] is mod  # the facade itself is untouched
    """, path=[fake_packages])


def test_installed_package_gets_only_its_entry_points_replaced_and_restored_by_identity(fake_packages: Path, run_python) -> None:
    run_python("""
        import inspect, wrapt
        import fakeup, fakeup.core
        originals = dict(vars(fakeup.core)); root = dict(vars(fakeup))
        installation = install(dialects=[FAKE], transformers=False)
        report = installation.reports["fake"]
        assert report.mode == "patch", report
        # a function: wrapped (upstream name, signature and __wrapped__ kept), calls go to the facade
        assert isinstance(fakeup.core.checkpoint, wrapt.FunctionWrapper)
        assert fakeup.core.checkpoint.__wrapped__ is originals["checkpoint"]
        assert fakeup.core.checkpoint.__name__ == "checkpoint"
        assert str(inspect.signature(fakeup.core.checkpoint)) == "(function, *args)"
        assert fakeup.core.checkpoint(lambda x: x + 1, 1) == ("acshim", 2)
        # the copy fakeup/__init__.py took with `from .core import checkpoint` is replaced too
        assert fakeup.checkpoint is fakeup.core.checkpoint
        # a class cannot be forwarded by a wrapper: replaced by the facade's class itself
        import fakefacade.core
        assert fakeup.core.Helper is fakefacade.core.Helper and fakeup.Helper is fakefacade.core.Helper
        # the rest of the package is untouched
        assert fakeup.core.untouched is originals["untouched"] and fakeup.untouched() == "upstream"
        assert fakeup.core.VALUE == 1
        # an entry point this upstream version lacks is skipped and reported, not added
        assert not hasattr(fakeup.core, "not_in_this_version")
        assert any("not_in_this_version" in why for why in report.missing), report.missing
        uninstall()
        assert all(vars(fakeup.core)[k] is v for k, v in originals.items()) and vars(fakeup.core).keys() == originals.keys()
        assert all(vars(fakeup)[k] is v for k, v in root.items()) and vars(fakeup).keys() == root.keys()
        assert fakeup.checkpoint(lambda x: x + 1, 1) == ("upstream", 2)
    """, path=[fake_packages])


def test_module_imported_after_install_is_patched_at_import_and_its_copies_restored(fake_packages: Path, run_python) -> None:
    run_python("""
        import wrapt, wrapt.importer
        installation = install(dialects=[FAKE], transformers=False)
        assert "fakeup.core" not in sys.modules and installation.reports["fake"].deferred == ["fakeup.core"]
        import fakeup.later                       # imports fakeup, fakeup.core: the hook patches core
        assert fakeup.later.ckpt(lambda: 3) == ("acshim", 3)
        assert fakeup.checkpoint is fakeup.core.checkpoint is fakeup.later.ckpt
        original = fakeup.core.checkpoint.__wrapped__
        uninstall()
        assert fakeup.core.checkpoint is original
        assert fakeup.checkpoint is original and fakeup.later.ckpt is original, "copies taken after patching"
        import fakeup.core as again
        assert again.Helper.origin == "upstream"
    """, path=[fake_packages])


def test_uninstall_before_first_import_leaves_no_hook_behind(fake_packages: Path, run_python) -> None:
    run_python("""
        import wrapt.importer
        install(dialects=[FAKE], transformers=False)
        assert "fakeup.core" in wrapt.importer._post_import_hooks
        uninstall()
        assert "fakeup.core" not in wrapt.importer._post_import_hooks
        import fakeup
        assert fakeup.checkpoint(lambda: 1) == ("upstream", 1)
        assert fakeup.Helper.origin == "upstream"
    """, path=[fake_packages])


def test_install_and_uninstall_are_idempotent(fake_packages: Path, run_python) -> None:
    run_python("""
        import fakeup
        uninstall()                                  # nothing installed: a no-op
        first = install(dialects=[FAKE, GHOST], transformers=False)
        wrapper, meta_path = fakeup.core.checkpoint, list(sys.meta_path)
        assert install(dialects=[FAKE, GHOST], transformers=False) is first
        assert install() is first and is_installed()
        assert fakeup.core.checkpoint is wrapper and sys.meta_path == meta_path
        assert not isinstance(fakeup.core.checkpoint.__wrapped__, type(wrapper)), "wrapped twice"
        uninstall(); uninstall()
        assert not is_installed() and fakeup.core.checkpoint is wrapper.__wrapped__
        again = install(dialects=[FAKE], transformers=False)   # and it can be installed again
        assert again is not first and fakeup.core.checkpoint(lambda: 1) == ("acshim", 1)
        uninstall()
    """, path=[fake_packages])


def test_failure_midway_rolls_back_every_change(fake_packages: Path, run_python) -> None:
    """The third attribute change raises: the finder, the aliases and the two attributes already
    replaced are all undone, and the error reaches the caller."""
    run_python("""
        import fakeup
        from acshim.patching import journal
        originals, root, meta_path = dict(vars(fakeup.core)), dict(vars(fakeup)), list(sys.meta_path)
        real_set_attribute, calls = journal.Journal.set_attribute, []
        def failing_set_attribute(self, owner, name, value):
            calls.append(name)
            if len(calls) == 3:
                raise RuntimeError("simulated failure")
            return real_set_attribute(self, owner, name, value)
        journal.Journal.set_attribute = failing_set_attribute
        try:
            install(dialects=[GHOST, FAKE], transformers=False)
        except RuntimeError as error:
            assert str(error) == "simulated failure"
        else:
            raise AssertionError("install should have failed")
        journal.Journal.set_attribute = real_set_attribute
        assert len(calls) == 3 and not is_installed()
        assert all(vars(fakeup.core)[k] is v for k, v in originals.items()) and vars(fakeup.core).keys() == originals.keys()
        assert all(vars(fakeup)[k] is v for k, v in root.items())
        assert sys.meta_path == meta_path
        try:
            import ghostpkg
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("the alias finder survived the rollback")
        install(dialects=[GHOST, FAKE], transformers=False)   # nothing half-done blocks a retry
        assert fakeup.core.checkpoint(lambda: 1) == ("acshim", 1)
    """, path=[fake_packages])


def test_broken_patch_list_is_rejected_naming_the_entry_and_nothing_stays_patched(fake_packages: Path, run_python) -> None:
    (fake_packages / "fakefacade" / "__init__.py").write_text(
        'ACSHIM_PATCHES = [("fakeup.core", "checkpoint", "fakefacade.core.checkpoint"),\n'
        '                  ("fakeup", "Helper", "fakefacade.core.NoSuchThing")]\n')
    run_python("""
        import fakeup
        original = fakeup.core.checkpoint
        from acshim.patching import PatchError
        try:
            install(dialects=[FAKE], transformers=False)
        except PatchError as error:
            assert "fakefacade.ACSHIM_PATCHES names 'fakefacade.core.NoSuchThing' for fakeup.Helper" in str(error), error
        else:
            raise AssertionError("a facade path that does not resolve must fail install")
        assert fakeup.core.checkpoint is original and fakeup.checkpoint is original and not is_installed()
    """, path=[fake_packages])


def test_patch_list_naming_torch_checkpoint_is_refused(fake_packages: Path, run_python) -> None:
    (fake_packages / "fakefacade" / "__init__.py").write_text(
        'ACSHIM_PATCHES = [("torch.utils.checkpoint", "checkpoint", "fakefacade.core.checkpoint")]\n')
    result = run_python("""
        import torch.utils.checkpoint as tc
        original = tc.checkpoint
        try:
            install(dialects=[Dialect("torchish", "torch", "fakefacade")], transformers=False)
        finally:
            assert tc.checkpoint is original
    """, path=[fake_packages], check=False)
    assert result.returncode == 1
    assert "torch.utils.checkpoint.checkpoint is called by acshim's engine itself" in result.stderr


def test_hidden_real_package_is_shimmed_and_visible_one_is_patched_in_place(run_python) -> None:
    """fairscale is installed here; hidden by a meta-path blocker it is served by the facade."""
    run_python("""
        import importlib.abc
        from acshim.patching import decide, dialect_named
        fairscale_dialect = dialect_named("fairscale")
        assert decide(fairscale_dialect) == "patch"

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "fairscale" or name.startswith("fairscale."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Blocker())
        assert decide(fairscale_dialect) == "shim"
        installation = install(dialects=["fairscale"], transformers=False)
        assert installation.reports["fairscale"].mode == "shim"
        from fairscale.nn.checkpoint import checkpoint_wrapper
        import acshim.facades.fairscale.nn.checkpoint as facade
        assert checkpoint_wrapper is facade.checkpoint_wrapper
        assert decide(fairscale_dialect) == "shim", "the alias must not make fairscale look installed"
        uninstall()
        assert "fairscale" not in sys.modules and "fairscale.nn.checkpoint" not in sys.modules
    """)


def test_torch_sagemaker_alias_is_removed_from_torch_on_uninstall(run_python) -> None:
    run_python("""
        import torch
        install(dialects=["torch.sagemaker"], transformers=False)
        import torch.sagemaker as tsm
        import acshim.facades.torch.sagemaker as facade
        assert tsm is facade and torch.sagemaker is facade
        uninstall()
        assert not hasattr(torch, "sagemaker") and "torch.sagemaker" not in sys.modules
    """)


def test_real_fairscale_and_deepspeed_keep_working_and_are_restored_exactly(run_python) -> None:
    run_python("""
        import torch, wrapt
        import fairscale, fairscale.nn, fairscale.nn.checkpoint.checkpoint_activations as fca
        import acshim.facades.fairscale as fairscale_facade, acshim.facades.deepspeed as deepspeed_facade
        targets = {}
        for module_name, attribute, _ in fairscale_facade.ACSHIM_PATCHES + deepspeed_facade.ACSHIM_PATCHES:
            if module_name in sys.modules:
                targets[(module_name, attribute)] = vars(sys.modules[module_name]).get(attribute)
        fairscale_names = dict(vars(fairscale.nn))
        installation = install(dialects=["fairscale", "deepspeed"], transformers=False)
        assert installation.reports["fairscale"].mode == "patch" and installation.reports["deepspeed"].mode == "patch"
        assert isinstance(fairscale.nn.checkpoint_wrapper, wrapt.FunctionWrapper)
        assert fairscale.nn.checkpoint_wrapper is fca.checkpoint_wrapper
        assert fairscale.nn.Pipe is fairscale_names["Pipe"], "the rest of fairscale is untouched"

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        wrapped = fairscale.nn.checkpoint_wrapper(model)
        assert wrapped is model, "acshim's checkpoint_wrapper works in place"
        wrapped(torch.randn(4, 8)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())

        import deepspeed
        assert isinstance(deepspeed.checkpointing.checkpoint, wrapt.FunctionWrapper)
        assert deepspeed.checkpointing is sys.modules["deepspeed.runtime.activation_checkpointing.checkpointing"]
        assert deepspeed.__version__.startswith("0.")  # real deepspeed, not the facade
        uninstall()
        for (module_name, attribute), original in targets.items():
            assert vars(sys.modules[module_name]).get(attribute) is original, (module_name, attribute)
        assert vars(fairscale.nn) == fairscale_names
        assert not isinstance(deepspeed.checkpointing.checkpoint, wrapt.FunctionWrapper)
        assert not isinstance(fairscale.nn.checkpoint_wrapper, wrapt.FunctionWrapper)
    """)
