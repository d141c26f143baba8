"""Readable math without a TeX engine: LaTeX source to Unicode text.

Models write math as LaTeX (``$\\frac{a}{b}$``, ``\\[\\sum_{i=1}^n x_i^2\\]``). Qt's rich text has
no MathML, and shipping a TeX renderer (or images of formulas) is heavy for a chat app, so we
translate the common subset into Unicode: Greek letters, operators, arrows, super/subscripts,
fractions as ``a⁄b`` or ``(a+b)/(c)``, roots as ``√x``. Anything unknown is kept as written
(minus the backslash), which is still readable. Pure Python, no Qt, easy to test.
"""

from __future__ import annotations

import unicodedata

SYMBOLS: dict[str, str] = {
    # Greek
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "varepsilon": "ε",
    "zeta": "ζ", "eta": "η", "theta": "θ", "vartheta": "ϑ", "iota": "ι", "kappa": "κ",
    "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ", "pi": "π", "varpi": "ϖ", "rho": "ρ",
    "sigma": "σ", "varsigma": "ς", "tau": "τ", "upsilon": "υ", "phi": "φ", "varphi": "φ",
    "chi": "χ", "psi": "ψ", "omega": "ω", "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ",
    "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π", "Sigma": "Σ", "Upsilon": "Υ", "Phi": "Φ", "Psi": "Ψ",
    "Omega": "Ω",
    # operators and relations
    "cdot": "·", "times": "×", "div": "÷", "pm": "±", "mp": "∓", "ast": "∗", "star": "⋆",
    "circ": "∘", "bullet": "•", "oplus": "⊕", "otimes": "⊗",
    "leq": "≤", "le": "≤", "geq": "≥", "ge": "≥", "neq": "≠", "ne": "≠", "approx": "≈",
    "equiv": "≡", "sim": "∼", "simeq": "≃", "cong": "≅", "propto": "∝", "ll": "≪", "gg": "≫",
    "in": "∈", "notin": "∉", "ni": "∋", "subset": "⊂", "subseteq": "⊆", "supset": "⊃",
    "supseteq": "⊇", "cup": "∪", "cap": "∩", "emptyset": "∅", "varnothing": "∅",
    "forall": "∀", "exists": "∃", "neg": "¬", "lnot": "¬", "land": "∧", "wedge": "∧",
    "lor": "∨", "vee": "∨", "mid": "∣", "parallel": "∥", "perp": "⊥",
    "sum": "∑", "prod": "∏", "coprod": "∐", "int": "∫", "iint": "∬", "iiint": "∭", "oint": "∮",
    "partial": "∂", "nabla": "∇", "infty": "∞", "hbar": "ℏ", "ell": "ℓ", "Re": "ℜ", "Im": "ℑ",
    "aleph": "ℵ", "angle": "∠", "degree": "°", "prime": "′",
    # arrows
    "to": "→", "rightarrow": "→", "leftarrow": "←", "gets": "←", "leftrightarrow": "↔",
    "Rightarrow": "⇒", "Leftarrow": "⇐", "Leftrightarrow": "⇔", "implies": "⇒", "iff": "⇔",
    "mapsto": "↦", "uparrow": "↑", "downarrow": "↓", "longrightarrow": "⟶",
    # dots, spacing, delimiters
    "ldots": "…", "dots": "…", "cdots": "⋯", "vdots": "⋮", "ddots": "⋱",
    "quad": "  ", "qquad": "    ", ",": " ", ";": " ", ":": " ", "!": "", " ": " ",
    "langle": "⟨", "rangle": "⟩", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉",
    "lvert": "|", "rvert": "|", "lVert": "‖", "rVert": "‖", "vert": "|", "Vert": "‖",
    "{": "{", "}": "}", "%": "%", "$": "$", "#": "#", "&": "&", "_": "_", "\\": "\n",
    # named functions are upright words
    "sin": "sin", "cos": "cos", "tan": "tan", "log": "log", "ln": "ln", "exp": "exp",
    "lim": "lim", "max": "max", "min": "min", "sup": "sup", "inf": "inf", "det": "det",
    "arg": "arg", "deg": "deg", "gcd": "gcd", "mod": "mod", "bmod": "mod", "arcsin": "arcsin",
    "arccos": "arccos", "arctan": "arctan", "sinh": "sinh", "cosh": "cosh", "tanh": "tanh",
}  # fmt: skip

# Commands that only change size or spacing of what follows: dropped.
IGNORED = {"left", "right", "big", "Big", "bigg", "Bigg", "displaystyle", "textstyle", "limits", "nolimits"}

BLACKBOARD = {"R": "ℝ", "N": "ℕ", "Z": "ℤ", "Q": "ℚ", "C": "ℂ", "P": "ℙ", "E": "𝔼"}
ACCENTS = {
    "hat": "\u0302",
    "bar": "\u0304",
    "overline": "\u0305",
    "vec": "\u20d7",
    "tilde": "\u0303",
    "dot": "\u0307",
}
TEXT_LIKE = {
    "text",
    "mathrm",
    "textrm",
    "mathit",
    "mathbf",
    "textbf",
    "operatorname",
    "mathsf",
    "mathtt",
    "boldsymbol",
}

SUPERSCRIPT = str.maketrans("0123456789+-=()niaeoxk", "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱᵃᵉᵒˣᵏ")
SUBSCRIPT = str.maketrans("0123456789+-=()aeoxijknmt", "₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑₒₓᵢⱼₖₙₘₜ")
_SUPERSCRIPTABLE = set("0123456789+-=()niaeoxk")
_SUBSCRIPTABLE = set("0123456789+-=()aeoxijknmt")


class _Parser:
    def __init__(self, src: str) -> None:
        self.src = src
        self.pos = 0

    def parse(self, stop: str | None = None) -> str:
        out: list[str] = []
        while self.pos < len(self.src):
            ch = self.src[self.pos]
            if stop is not None and ch == stop:
                self.pos += 1
                return "".join(out)
            if ch == "\\":
                out.append(self._command())
            elif ch == "{":
                self.pos += 1
                out.append(self.parse("}"))
            elif ch in "^_":
                self.pos += 1
                arg = self._argument()
                out.append(_script(arg, superscript=ch == "^"))
            elif ch == "~":
                self.pos += 1
                out.append(" ")
            elif ch == "&":
                self.pos += 1
                out.append(" ")
            else:
                self.pos += 1
                out.append(ch)
        return "".join(out)

    def _argument(self) -> str:
        """One argument: a {group}, a \\command, or a single character."""
        while self.pos < len(self.src) and self.src[self.pos] == " ":
            self.pos += 1
        if self.pos >= len(self.src):
            return ""
        ch = self.src[self.pos]
        if ch == "{":
            self.pos += 1
            return self.parse("}")
        if ch == "\\":
            return self._command()
        self.pos += 1
        return ch

    def _command(self) -> str:
        self.pos += 1  # the backslash
        start = self.pos
        while self.pos < len(self.src) and self.src[self.pos].isalpha():
            self.pos += 1
        if self.pos == start and self.pos < len(self.src):  # \, \; \{ \\ ...
            self.pos += 1
        name = self.src[start : self.pos]
        if name in IGNORED:
            return ""
        if name in ("frac", "dfrac", "tfrac"):
            num, den = self._argument(), self._argument()
            if len(num) == 1 and len(den) == 1:
                return f"{num}⁄{den}"
            return f"{_wrap(num)}/{_wrap(den)}"
        if name == "sqrt":
            degree = ""
            if self.pos < len(self.src) and self.src[self.pos] == "[":
                end = self.src.find("]", self.pos)
                if end != -1:
                    degree = self.src[self.pos + 1 : end]
                    self.pos = end + 1
            arg = self._argument()
            root = {"3": "∛", "4": "∜"}.get(degree, (_script(degree, True) if degree else "") + "√")
            return root + _wrap(arg)
        if name == "binom":
            n, k = self._argument(), self._argument()
            return f"C({n}, {k})"
        if name == "mathbb":
            arg = self._argument()
            return "".join(BLACKBOARD.get(c, c) for c in arg)
        if name in ACCENTS:
            arg = self._argument()
            return arg + ACCENTS[name] if len(arg) == 1 else f"{arg}{ACCENTS[name]}"
        if name in TEXT_LIKE:
            return self._argument()
        if name in ("begin", "end"):
            self._argument()  # environment name: matrices etc. degrade to their cells
            return ""
        return SYMBOLS.get(name, name)


def _wrap(text: str) -> str:
    """Parenthesise a fraction/root operand unless it is a single token."""
    if not any(c in " +-−=/·×,<>≤≥" for c in text) or (text.startswith("(") and text.endswith(")")):
        return text
    return f"({text})"


def _script(text: str, superscript: bool) -> str:
    allowed = _SUPERSCRIPTABLE if superscript else _SUBSCRIPTABLE
    if text and all(c in allowed for c in text):
        return text.translate(SUPERSCRIPT if superscript else SUBSCRIPT)
    if text == "′" or text == "'":
        return "′"
    return ("^" if superscript else "_") + _wrap(text)


def tex_to_unicode(tex: str) -> str:
    """``\\frac{1}{2} \\alpha^2`` -> ``1⁄2 α²``."""
    text = _Parser(tex.strip()).parse()
    text = " ".join(part for part in text.split(" ") if part) if "\n" not in text else text.strip()
    return unicodedata.normalize("NFC", text)  # y + combining hat -> ŷ where a precomposed one exists
