"""Hostile chat templates (issue 23, finding 8): a GGUF's template is code from whoever made the file."""

from __future__ import annotations

import time

import pytest

from services.inference.chat_template import ChatTemplate, TemplateError

pytestmark = pytest.mark.security


@pytest.mark.parametrize("template, refused", [
    # CVE-2024-34359 (llama-cpp-python): a GGUF's chat template reaching os through the subclasses of object.
    pytest.param("{% for x in ().__class__.__base__.__subclasses__() %}{% if 'warning' in x.__name__ %}"
                 "{{ x()._module.__builtins__['__import__']('os').system('touch PWNED') }}{% endif %}{% endfor %}",
                 "unsafe", id="cve-2024-34359"),
    pytest.param("{{ cycler.__init__.__globals__.os.system('touch PWNED') }}", "unsafe", id="globals"),
    # Sized so that main, which computed them (the constant ones while compiling), fails fast: a template can
    # ask for 9 ** 99999999, 'a' * 10**10 or range(100000) inside range(100000) as easily.
    pytest.param("{{ (9 ** 1000000) | string | length }}", "4096 bits", id="power"),
    pytest.param("{{ ('a' * 200000000) | length }}", "sequence over", id="repeat"),
    pytest.param("{% for i in range(100000) %}{% for j in range(20) %}{% endfor %}{% endfor %}", "ranges go over",
                 id="nested-ranges"),
])
def test_a_hostile_chat_template_renders_nothing_dangerous(template, refused, tmp_path, monkeypatch):
    """Finding 8: a GGUF's tokenizer.chat_template is code from whoever made the file."""
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(TemplateError, match=refused):
        ChatTemplate(template).render_text([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 2 and not (tmp_path / "PWNED").exists()
    assert ChatTemplate("{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ 123456 * 654321 }}").render_text([]) == \
        "1024 ababab 80779853376"
