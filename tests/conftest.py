import gc
import os
import signal
import sys

import pytest

# Tests import helpers as `tests._dist`; ranks started by the harness need the same path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_report_header(config):
    # The fault-tolerance tests' kill points come from a fixed seed; say which, so a run can be repeated.
    from tests.test_fault_tolerance import POINTS, SEED

    return f"kill points (DPTRAIN_KILL_SEED={SEED}): " + ", ".join(f"rank {r} at batch {b}" for r, b in POINTS)


# Under pytest-xdist (`make test` runs `-n JOBS --dist loadgroup` where it is installed) the tests
# of each group below run one after another on one worker, beside the other tests but never
# beside each other. NAMESPACES: two or three "nodes" in network namespaces with fixed
# addresses and ports (benchmarks/netlink.py), and a look at /dev/shm as a whole.
NAMESPACES = {
    "tests/test_netlink.py", "tests/test_shm_nodes.py", "tests/launcher/test_auth.py",
    "tests/launcher/test_multinode.py", "tests/launcher/test_inplace_resize.py", "tests/launcher/test_elastic.py",
    "tests/launcher/test_admission.py", "tests/test_diloco_inplace.py", "tests/parallel/test_diloco_nodes.py",
    "tests/test_benchmark_diloco.py",
}
# KILLS: jobs on loopback whose ranks are killed, stalled or raced at their exit at chosen
# moments, and the launcher's own processes counted (test_clean_exit's races need a CPU to
# themselves to show; two of these side by side would also read each other's processes).
KILLS = {
    "tests/test_clean_exit.py", "tests/test_inplace_recovery.py", "tests/launcher/test_membership.py",
    "tests/launcher/test_inplace_launcher.py", "tests/launcher/test_launch_lifecycle.py",
}
SERIAL = NAMESPACES | KILLS
# One worker runs test_warm_server's tests, so that its module's server (the `warm` fixture) starts
# once; and test_docs's, whose module fixture starts every block of the file at once (spread over
# the workers, each worker's fixture ran every block again: three times the blocks, six warm parents).
GROUPS = {"namespaces": NAMESPACES, "kills": KILLS, "template-servers": {"tests/launcher/test_warm_server.py"},
          "docs": {"tests/test_docs.py"}}


def xdist_group(nodeid):
    """The group a test's node id belongs to (None: scheduled alone)."""
    path = nodeid.split("::", 1)[0]
    return next((name for name, files in GROUPS.items() if path in files), None)


# [Note: the groups are the scheduler's, not markers]
# xdist's own loadgroup learns a test's group from an "@group" suffix its workers write into the node
# id from an xdist_group marker; pytest 9.2's node ids no longer take that write
# (pytest-dev/pytest-xdist#1386), and a marker added by a conftest hook came after the write anyway:
# the groups' files ran on every worker at once. So the controller's scheduler asks xdist_group()
# itself: a loadscope scheduler whose unit is a group, or a test alone, on every pytest and xdist.
# (optionalhook: without xdist installed the suite runs serially and the hook is unknown.)
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            # An "@group" suffix, where an xdist marker still makes one, names a group too.
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[1]
            return xdist_group(nodeid) or nodeid

    return FileGroups(config, log)


# `make check` (-m "not slow"), the inner loop's subset, leaves these files out: each of their
# tests starts jobs of fresh interpreters (dptrain run, torchrun, a script, a kernel, a venv),
# kills ranks or nodes, or waits on purpose; together they are most of the suite's time. A test
# elsewhere can say the same with @pytest.mark.slow.
SLOW = SERIAL | {
    "tests/test_examples.py", "tests/test_readme.py", "tests/test_docs.py", "tests/test_setup.py",
    "tests/test_fault_tolerance.py", "tests/test_trainer_kills.py", "tests/test_preemption.py",
    "tests/test_interrupt.py", "tests/test_trainer_trackers.py", "tests/test_trainer_stream.py",
    "tests/test_cuda_present.py", "tests/test_profile.py", "tests/parallel/ddp/test_ddp_compile.py",
    "tests/parallel/ddp/test_ddp_script.py", "tests/launcher/test_launch.py", "tests/launcher/test_rank_logs.py",
    "tests/launcher/test_relay.py", "tests/launcher/test_spare_memory.py", "tests/launcher/test_spawn_notebook.py",
    "tests/launcher/test_template.py", "tests/launcher/test_watch.py", "tests/launcher/test_warm_server.py",
}


# And these tests of otherwise quick files, for the same reasons (a `dptrain run` or torchrun job,
# a fresh interpreter, a wait for a timeout on purpose): by node id, parameters included.
SLOW_TESTS = (
    "tests/test_env.py::test_a_rank_that_cannot_reach_the_master_says_what_it_waits_for",
    "tests/test_env.py::test_a_peer_stalled_in_a_second_init_is_not_named_as_one_that_shut_down",
    "tests/test_env.py::test_init_again_after_shutdown_under_a_launcher_meets_the_peers_second_init",
    "tests/test_env.py::test_plain_python_under_slurm_names_the_missing_ranks_and_srun",
    "tests/test_env.py::test_a_forgotten_init_under_a_launcher_is_refused_naming_dptrain_init",
    "tests/test_env.py::test_dptrain_run_of_a_script_without_init_fails_naming_dptrain_init",
    "tests/test_stream.py::test_hugging_face_streaming_from_local_files",
    "tests/test_trainer.py::test_kill_9_and_launcher_restart_gives_the_uninterrupted_model",
    "tests/test_cli_config.py::test_two_ranks_under_dptrain_run_read_the_file_and_the_override",
    "tests/test_cli_config.py::test_a_script_prints_one_line_and_exits_2_and_imports_jsonargparse_only_then",
    "tests/parallel/test_guarded_paths.py::test_a_stalled_peer_is_named_on_every_path_outside_the_buckets",
    "tests/test_checkpoint_safety.py::test_a_second_run_restarted_before_its_trainer_was_built_does_not_continue_the_first",
    "tests/test_trainer_messages.py::test_a_user_error_is_one_line_for_the_job_and_the_traceback_needs_debug",
    "tests/test_sampler_memory.py::test_an_epoch_of_5e7_samples_costs_a_tensor_not_a_list",
    "tests/launcher/test_store.py::test_a_job_runs_with_either_server_and_only_torchs_makes_the_launcher_import_torch",
    "tests/test_gpu_benchmark.py::test_the_gpu_benchmark_runs_on_one_rank_and_prints_both_ratios",
    "tests/launcher/test_store_values.py::test_dptrain_run_goes_on_past_a_malformed_heartbeat",
    "tests/test_regroup.py::test_a_survivor_waiting_for_a_slow_replacement_prints_no_store_timeouts",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in SLOW or item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


# The jobs the tests start share warm templates (DPTRAIN_TEMPLATE_SERVERS, see [Note: a warm template
# for many jobs] in dptrain/launcher/served.py): a job's template is forked in milliseconds from
# a server that imported torch once, where it would import torch itself for seconds of CPU. The
# tests of the template itself, of which process is whose parent and of what the launcher adopts
# start their own (OWN_TEMPLATE); DPTRAIN_TEST_SHARED_TEMPLATES=0 makes every test do so.
# A job inside a network namespace (the NAMESPACES files' nodes) is served too: its template enters
# the namespace, and its launcher starts its key's server outside it (the namespace lasts one test).
OWN_TEMPLATE = {
    "tests/launcher/test_template.py", "tests/launcher/test_inplace_launcher.py",
    "tests/launcher/test_launch_lifecycle.py",
}
_SERVERS = "DPTRAIN_TEMPLATE_SERVERS"


def _share_templates(config):
    """Make the folder of the run's template servers (once: xdist's workers inherit it)."""
    import tempfile

    if _SERVERS in os.environ or os.environ.get("DPTRAIN_TEST_SHARED_TEMPLATES", "1") == "0":
        return
    os.environ[_SERVERS] = config._dptrain_servers = tempfile.mkdtemp(prefix="dptrain-templates-")
    # What scikit-learn (and joblib) put into os.environ when a test first imports them (the digits
    # example's data): OpenMP settings, so part of a server's import key. Set from the start, every
    # job of a worker has the key it would have after that import, not one before and one after
    # (half the suite's jobs met a key whose server was not up yet and imported torch themselves).
    for name, value in (("KMP_DUPLICATE_LIB_OK", "True"), ("KMP_INIT_AT_FORK", "FALSE")):
        os.environ.setdefault(name, value)


def _stop_template_servers(folder):
    import glob
    import shutil

    from tests._warm import stop_template_servers

    for private in glob.glob(os.path.join(folder, "*", "")):  # the servers' private folder(s) inside
        stop_template_servers(private)
    shutil.rmtree(folder, ignore_errors=True)  # a server that missed the signal sees its folder gone


def pytest_unconfigure(config):
    folder = getattr(config, "_dptrain_servers", None)
    if folder:
        _stop_template_servers(folder)


def pytest_runtest_setup(item):
    if item.nodeid.split("::", 1)[0] in OWN_TEMPLATE:
        item._dptrain_servers = os.environ.pop(_SERVERS, None)


def pytest_runtest_teardown(item, nextitem):
    folder = getattr(item, "_dptrain_servers", None)
    if folder:
        os.environ[_SERVERS] = folder


# The collector and the suite's own process (each xdist worker): collecting imports torch, dptrain
# and every test module, a million-odd objects that live as long as the process, and a third of a
# worker's CPU went to collections walking them again and again (perf, 2026-12-07). So the
# collector is off while they are made, and they are frozen out of it once collected; what the
# tests themselves make is collected as usual.
def pytest_collection_finish(session):
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    gc.enable()  # every process runs this after collecting (xdist's controller too, which collects nothing)


def pytest_configure(config):
    gc.disable()  # until the collection is done (above)
    _share_templates(config)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # An xdist worker ignores SIGINT (its controller handles ^C); a process a test forks or
        # starts from it would inherit that, and the tests that interrupt a job need the default.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # DPTRAIN_TEST_TIMING=<path>: per-file wall and CPU time of the run (tests/_timing.py).
    path = os.environ.get("DPTRAIN_TEST_TIMING")
    if path:
        from tests._timing import TimingPlugin

        config.pluginmanager.register(TimingPlugin(path), "dptrain-timing")
