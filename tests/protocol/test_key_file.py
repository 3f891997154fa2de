"""load_key: a key file that group or others may read or write is refused, as ssh does."""
import os

import pytest

from nemo_dcr.protocol.signing import KEY_ENV, SignatureError, load_key, new_key_file


@pytest.fixture
def key_path(tmp_path) -> str:
    return new_key_file(str(tmp_path / "run.key"))


def test_new_key_files_are_private_and_load(key_path):
    assert os.stat(key_path).st_mode & 0o777 == 0o600
    key = load_key(key_path)
    assert key is not None and len(key) == 32


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_modes_are_accepted(key_path, mode):
    os.chmod(key_path, mode)
    assert load_key(key_path) is not None


@pytest.mark.parametrize("mode, who", [
    (0o640, "readable by group"),
    (0o604, "readable by others"),
    (0o644, "readable by group and others"),
    (0o620, "writable by group"),
    (0o666, "readable by group and others, writable by group and others"),
    (0o601, "executable by others"),
])
def test_modes_open_to_group_or_others_are_refused(key_path, mode, who):
    assert load_key(key_path) is not None  # control: the same file at 0600
    os.chmod(key_path, mode)
    with pytest.raises(SignatureError) as e:
        load_key(key_path)
    assert str(e.value) == (f"signing key {key_path!r}: permissions {mode:04o} are too open ({who}); "
                            f"run: chmod 600 {key_path}")
    os.chmod(key_path, 0o600)
    assert load_key(key_path) is not None  # and the advice works


def test_the_environment_variable_path_is_checked_too(key_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, key_path)
    assert load_key() is not None
    os.chmod(key_path, 0o644)
    with pytest.raises(SignatureError, match="are too open"):
        load_key()


def test_the_advice_quotes_a_path_with_spaces(tmp_path):
    path = new_key_file(str(tmp_path / "my key"))
    os.chmod(path, 0o644)
    with pytest.raises(SignatureError, match=r"run: chmod 600 '.*/my key'$"):
        load_key(path)


def test_unreadable_malformed_and_huge_key_files(tmp_path):
    with pytest.raises(SignatureError, match=r"No such file"):
        load_key(str(tmp_path / "absent"))
    bad = tmp_path / "bad"
    for text, match in (("zz" * 32, "not a hex string"), ("ab" * 8 + "a", "not a hex string"),
                        ("ab" * 15, "15 bytes, at least 16 needed"), ("ab" * 5000, "more than 4096 characters")):
        bad.write_text(text)
        os.chmod(bad, 0o600)
        with pytest.raises(SignatureError, match=match):
            load_key(str(bad))
    bad.write_text("ab" * 16 + "\n")  # control
    assert load_key(str(bad)) == b"\xab" * 16
