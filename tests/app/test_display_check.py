"""The launcher's display check: the right platform, or a message naming what to install."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.display_check import DisplayCheck, check, install_advice, missing_libraries, x_server_reachable

LINUX = "linux"


def _never_called(*_args) -> list[str]:
    raise AssertionError("nothing needs checking here")


def _up(display: str) -> bool:
    return True


def test_missing_xcb_libraries_name_their_packages_for_each_distribution() -> None:
    result = check(
        {"DISPLAY": ":0"},
        platform=LINUX,
        find_missing=lambda: ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"],
        reachable=_up,
    )
    assert result.platform is None
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1" in result.problem
    assert "sudo apt-get install -y libxcb-icccm4 libxcb-keysyms1" in result.problem
    assert "sudo dnf install -y xcb-util-wm xcb-util-keysyms" in result.problem
    assert "sudo pacman -S --needed xcb-util-wm xcb-util-keysyms" in result.problem


def test_an_unknown_library_is_named_not_dropped() -> None:
    advice = install_advice(["libxcb-cursor.so.0", "libweird.so.7"])
    assert "libxcb-cursor0 <the package providing libweird.so.7>" in advice


def test_a_complete_system_keeps_qts_own_choice() -> None:
    assert check({"DISPLAY": ":0"}, platform=LINUX, find_missing=list, reachable=_up) == DisplayCheck()


@pytest.mark.parametrize("environ", [{}, {"DISPLAY": ":0"}])
def test_headless_modes_run_offscreen_unless_the_user_chose(environ: dict) -> None:
    kwargs = {"platform": LINUX, "find_missing": _never_called, "reachable": _never_called}
    assert check(environ, headless=True, **kwargs) == DisplayCheck(platform="offscreen")
    assert check({"QT_QPA_PLATFORM": "vnc"}, headless=True, **kwargs) == DisplayCheck()


def test_a_display_nobody_answers_on_is_named() -> None:
    result = check({"DISPLAY": "remote:10.0"}, platform=LINUX, find_missing=list, reachable=lambda d: False)
    assert "'remote:10.0'" in result.problem and "no X server" in result.problem


def test_x_server_reachable_tries_the_display_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        if port <= 6000:
            pytest.skip("the system gave a port below X's range")
        assert x_server_reachable(f"127.0.0.1:{port - 6000}")
        assert x_server_reachable(f"127.0.0.1:{port - 6000}.0")
    assert not x_server_reachable(f"127.0.0.1:{port - 6000}", timeout_s=0.5)
    assert not x_server_reachable("not a display")


def test_the_window_without_a_display_says_so() -> None:
    result = check({}, platform=LINUX, find_missing=_never_called, reachable=_never_called)
    assert "no display was found" in result.problem and "--ask" in result.problem


@pytest.mark.parametrize(
    "environ, platform",
    [({"QT_QPA_PLATFORM": "offscreen"}, LINUX), ({"WAYLAND_DISPLAY": "wayland-0"}, LINUX), ({}, "win32")],
)
def test_no_check_where_qt_will_not_use_xcb(environ: dict, platform: str) -> None:
    assert (
        check(environ, platform=platform, find_missing=_never_called, reachable=_never_called)
        == DisplayCheck()
    )


def test_ldd_output_is_read_for_every_missing_library(tmp_path: Path) -> None:
    fake_ldd = tmp_path / "ldd"
    fake_ldd.write_text(
        "#!/bin/sh\n"
        "echo '\tlibxcb-icccm.so.4 => not found'\n"
        "echo '\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x0000)'\n"
        "echo '\tlibxcb-keysyms.so.1 => not found'\n"
        "echo '\tlibxcb-icccm.so.4 => not found'\n"
    )
    fake_ldd.chmod(0o755)
    missing = missing_libraries(Path("/nonexistent/libqxcb.so"), ldd=str(fake_ldd))
    assert missing[:2] == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux launcher check")
def test_the_launcher_prints_the_problem_instead_of_aborting(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TRELLIS_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run(
        [sys.executable, "-m", "app"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "no display was found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux launcher check")
def test_about_runs_with_a_display_it_cannot_use(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DISPLAY": ":99"}
    env["TRELLIS_DATA_DIR"] = str(tmp_path / "data")
    result = subprocess.run(
        [sys.executable, "-m", "app", "--about"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Models folder:" in result.stdout
