"""``csframework.errors``: what is echoed to the console from a file or a config cannot forge a line."""
from csframework.errors import printable


def test_control_characters_are_escaped_for_the_console():
    assert printable("val/loss\n[fake] csframework: done\x1b[2K\u202e") == \
        "val/loss\\n[fake] csframework: done\\x1b[2K\\u202e"
