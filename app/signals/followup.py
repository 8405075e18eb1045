"""Classify the user's next message as dissatisfied with the assistant's last answer.

Transparent rules, English and Chinese. Each rule is a named pattern with a weight:
3 = unambiguous on its own (pasted error output, "still broken", "revert that", "不对"),
2 = a complaint unless softened by praise ("you deleted …", a leading "no,"),
1 = a weak cue that needs company ("ugh", "??"), -1 = praise ("thanks", "谢谢").
A message is dissatisfied when its score reaches THRESHOLD. A match is suppressed when
its clause sets it up as a condition, a question about how to do something, or a negation
("if it fails, …", "how do I revert …", "没报错了"); praise does not count after "but"/"但是".
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

THRESHOLD = 2
# Prose rules read the head and tail of long messages: the complaint wraps a paste, and
# scanning 16 kB of pasted code with every phrase rule costs ~50 ms.
PROSE_WINDOW = 2_000

# Clause boundaries for the negation / condition checks (full-width marks are NFKC'd).
_CLAUSE_BREAKS = ".!?;:,\n。"
_CONDITION_EN = (
    r"\b(?:if|when|whenever|unless|in case|whether|make sure|makes sure|ensure|so that"
    r"|instead of|(?:check|test|verify|assert)s? that)\b"
)
_CONDITION_ZH = r"(?:如果|若|万一|要是|假如|当)"
_CONDITION_ZH_AFTER = r"^\s*(?:的时候|时|的话|后|就)"
_CONTRAST = re.compile(r"\b(?:but|however|although|though|except|yet)\b|但|可是|然而|不过,")


@dataclass(frozen=True)
class Rule:
    """A named pattern; a match is void when its clause has `unless_before`/`unless_after`."""

    name: str
    weight: int
    pattern: re.Pattern[str]
    unless_before: re.Pattern[str] | None = None
    unless_after: re.Pattern[str] | None = None


@dataclass(frozen=True)
class Hit:
    """One rule that fired on a message, with the text it matched."""

    rule: str
    weight: int
    text: str
    suppressed_by: str | None = None


def _rule(
    name: str,
    weight: int,
    pattern: str,
    *,
    unless_before: str | None = None,
    unless_after: str | None = None,
    flags: int = 0,
) -> Rule:
    return Rule(
        name,
        weight,
        re.compile(pattern, flags),
        re.compile(unless_before) if unless_before else None,
        re.compile(unless_after) if unless_after else None,
    )


# Tool output, matched case-sensitively on the raw message: what compilers, test runners
# and interpreters print, anchored to line starts so prose that mentions them does not fire.
# Indentation is `[ \t]`, never `\s`: under MULTILINE `^\s*` at every line start would run
# over all the newlines after it, quadratic in a message of blank lines.
TOOL_OUTPUT_RULES: tuple[Rule, ...] = tuple(
    _rule(name, 3, pattern, flags=re.MULTILINE)
    for name, pattern in (
        (
            "python_traceback",
            r"Traceback \(most recent call last\)|^[ \t]*File \"[^\"\n]+\", line \d+",
        ),
        (
            "exception_line",
            r"^[ \t]*(?:E\s+|Uncaught\s+(?:\(in promise\)\s+)?)?(?:[A-Za-z_]\w*\.)*"
            r"[A-Z]?\w*(?:Error|Exception)(?::\s|\s*$)|Exception in thread \"",
        ),
        (
            "stack_frame",
            # The frame's name, when there is one, ends at the space or parenthesis before
            # its location, so the name and the location never compete for the same
            # characters: a long line is tried once, not once per split of it.
            r"^[ \t]+at (?:[\w.$<>\[\] ]*[ (])?[^\s()]+:\d+(?::\d+)?\)?\s*$"
            r"|^[ \t]*[\w./-]+:\d+:in [`']",
        ),
        (
            "compiler_error",
            r"^[ \t]*[\w./\\-]+\.\w+:\d+(?::\d+)?:?\s*(?:-\s*)?(?:fatal\s+)?error\b"
            r"|\berror\[E\d{4}\]|\berror TS\d+:|^error: could not compile"
            r"|^[\w./-]+\.go:\d+:\d+: |^[ \t]*e: file:|Unresolved reference:|undefined reference to"
            r"|^[ \t]*\d+:\d+\s+error\s|^TS\d{4}: |^Found \d+ errors? in|✖ \d+ problems?"
            r"|^(?:fatal )?error: ",
        ),
        (
            "test_failure",
            r"^FAILED \S|^[ \t]*FAIL\s+\S+\.\w+|\b[1-9]\d* failed(?:[,;]| in )|test result: FAILED"
            r"|\.\.\. FAILED\s*$|^=+ (?:FAILURES|ERRORS) =+|Interrupted: \d+ errors?"
            r"|panicked at ",
        ),
        (
            "tool_error",
            r"^npm ERR!|^[ \t]*(?:#\d+ [\d.]+ )?ERROR:?\s|^[ \t]*=> ERROR\b|BUILD FAILED"
            r"|Build failed|^> Task \S+ FAILED|command not found\s*$|^Require stack:",
        ),
        (
            "exit_status",
            r"(?:^|finished with |successfully: )exit (?:code|status):? ?[1-9]\d*"
            r"|^g?make(?:\[\d+\])?: \*\*\*"
            r"|returned [1-9]\d* exit status",
        ),
        (
            "crash",
            r"Segmentation fault(?: \(core dumped\))?\s*$|\(core dumped\)|\bSIG(?:SEGV|ABRT|BUS)\b"
            r"|^panic: |^goroutine \d+ \[running\]|^fatal error: ",
        ),
    )
)

_SUBJECT = (
    r"(?:it|this|that|everything|the (?:app|page|server|service|build|script|program|process"
    r"|tests?|ui|site|job|loop|function|query|request|endpoint|api|container|command|code))"
)

# Phrases, matched on the normalised (NFKC, lower-case) message.
PHRASE_RULES: tuple[Rule, ...] = (
    _rule(
        "still_broken",
        3,
        r"\bstill\b[^.!?\n]{0,40}?\b(?:fail\w*|broke\w*|break\w*|error\w*|crash\w*|wrong|bug\w*"
        r"|issue\w*|problem\w*|same|exception\w*|throw\w*|hang\w*|freez\w*|stuck|leak\w*|none"
        r"|null|nan|empty|blank|nothing|missing|slow\w*|flicker\w*|[45]\d\d|not|never"
        r"|(?:does|do|did|is|are|was|were|wo|ca|could|has|have)n'?t)\b"
        r"|\b(?:bug|error|issue|problem|leak|warning|exception|crash|flicker|glitch)\w*\s+"
        r"(?:is\s+|are\s+)?still\b|\A\s*still\W*\Z",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "same_problem",
        3,
        r"\b(?:same|identical)\s+(?:\w+\s+)?(?:error|problem|issue|exception|result|output|bug"
        r"|behaviou?r|failure|mistake|crash|traceback|message|warning|\w+error|\w+exception"
        r"|[45]\d\d)\b",
        unless_before=r"\b(?:fix|fixes|handle|avoid|prevent|do|apply)\b",
    ),
    _rule(
        "no_effect",
        3,
        r"\bnothing (?:has )?changed\b|\bno change\b|\bno (?:difference|effect)\b"
        r"|\b(?:did|does)(?:n'?t| not) (?:change|do) (?:anything|a thing)\b|\bmade no difference\b"
        r"|\b(?:does nothing|nothing happens|(?:is|isn'?t|is not|not) doing anything)\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "not_working",
        3,
        r"\b(?:does|did|is|was|are|were|wo|ca|still)(?:n'?t| not) (?:\w+ ){0,2}?(?:work|compile"
        r"|build|run|start|load|fix|help|solve|pass|match|render|install|deploy|parse|connect)"
        r"\w*\b|\bnot (?:working|fixed|compiling|solved|helping|resolved|rendering|loading)\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "wrong",
        3,
        r"\b(?:that|this|it|output|answer|result|results|value|values|logic|code|fix|change"
        r"|version|query|math|calculation|order|format|number|numbers|total|sum|count"
        r"|everything)(?:'s|'re| is| are| was| were| looks| seems)(?: \w+){0,2}? (?:wrong"
        r"|incorrect|not (?:right|correct|quite right|it)|off by)\b"
        r"|\bthat'?s not (?:quite )?(?:it|how)\b|\bnot quite (?:it|right)\b"
        r"|\bdon'?t think (?:that|this|it)(?:'s| is) (?:right|correct)\b"
        r"|\b(?:does|do)(?:n'?t| not) (?:look|seem|feel) (?:right|correct)\b"
        r"|\b(?:wrong|incorrect) again\b|\byou(?:'re| are| got it| got that)(?: \w+)? wrong\b"
        r"|\byou(?: \w+){1,4} the wrong\b",
        unless_before=r"\b(?:if|whether|unless|in case|nothing)\b",
    ),
    _rule(
        "not_what_asked",
        3,
        r"\bnot (?:what|how) (?:i|we) (?:asked|wanted|meant|said|need|needed|want)\b"
        r"|\bthat'?s not what\b|\bopposite of what\b"
        r"|\b(?:no|as|like),? i (?:said|told you|asked|mentioned)\b"
        r"|\bi (?:already )?told you\b|\bi didn'?t ask\b|\bwho asked you\b|\byou ignored\b"
        r"|\bi (?:only |just |specifically |explicitly |clearly )?asked (?:you )?(?:for|to)\b",
    ),
    _rule(
        "revert_request",
        3,
        r"(?:^|[,.;:!?\n][ \t]*)(?:(?:please|pls|just|can you|could you|would you|ok|okay|so|then"
        r"|now)\s+)?(?:revert|undo|roll ?back|back out)(?:\s+(?:that|this|it|them|those"
        r"|everything|all|your|the|my|what|to)\b|\s*$|\s*[,.!])"
        r"|\b(?:put|change|move) (?:it|them|that|this|those|these|everything|\w+) back\b"
        r"|\broll (?:it|that|this|them|those|everything) back\b|\b(?:was|were) better before\b"
        r"|\bgo back to (?:the )?(?:old|original|previous|how it was|what it was)\b"
        r"|\brestore (?:it|them|my|the (?:old|original|previous|deleted|removed))\b",
        unless_before=r"\b(?:how|no need to|don'?t|do not|never)\b",
        unless_after=r"^\s*(?:is|isn't|not|button|feature|support)\b|not needed|unnecessary",
    ),
    _rule(
        "broke_it",
        3,
        r"\b(?:you|that|this|it|your (?:change|edit|fix|code|patch|commit|refactor|update)"
        r"|the (?:fix|change|edit|patch|update|refactor|new code|last change))(?: just| have"
        r"| has|'ve)? (?:broke|breaks|ruined|messed up|screwed up|wrecked|killed)\b"
        r"|\b(?:is|are|'s|'re|now|got|all) broken\b"
        r"|\bmade (?:it|this|that|things|everything) (?:worse|slower)\b"
        r"|\b(?:worse|slower) than (?:before|it was|the original)\b"
        r"|\b(?:is|are|got|getting|even|much|way) (?:even |much |way )?(?:worse|slower)\b"
        r"|\b(?:introduced|caused) (?:a |an |another |new |\d+ )*(?:bugs?|regressions?|issues?"
        r"|problems?)\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "crashes_or_hangs",
        3,
        _SUBJECT + r"(?:'s| is| now| still)? (?:now )?(?:crash(?:es|ed|ing)?|hangs?|hanging"
        r"|hung|freez(?:es|ing)|froze|fails|failing|failed|throws?|throwing|errors out"
        r"|segfaults?|panics|blows up|times out|timing out|never (?:terminates|returns"
        r"|finishes|ends|stops|loads))\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "build_or_tests_fail",
        3,
        r"\b(?:compil(?:e|ation)|build|ci|pipeline|tests?|deploy(?:ment)?|install(?:ation)?)"
        r" (?:now |still |again |all )?(?:fail|fails|failed|failing|is failing|are failing"
        r"|is broken|are broken|broke)\b",
        unless_before=_CONDITION_EN + r"|\b(?:make|let|should|must|will|would|to)\b",
    ),
    _rule(
        "blank_page",
        3,
        r"\b(?:blank|white) (?:page|screen)\b"
        r"|\b(?:page|screen|window|ui) (?:is |goes |went |now |just )*(?:blank|white|empty)\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "made_up",
        3,
        r"\b(?:does|do|did)(?:n'?t| not) exist\b|\bthere(?:'s| is) no such\b|\bhallucinat\w*"
        r"|\bno such (?:method|function|attribute|module|file|class|option|flag|api|endpoint"
        r"|parameter|argument|field|column|package|command|property|hook|library)\b"
        r"|\bmade (?:that|it|this|those) up\b",
        unless_before=_CONDITION_EN,
    ),
    _rule(
        "frustration",
        3,
        r"\bwtf\b|\bffs\b|\bare you (?:serious|kidding)\b|\bhow many times\b|\bsame mistake\b"
        r"|\b(?:second|third|fourth|fifth|\d+(?:st|nd|rd|th)) time\b"
        r"|\bwhat (?:the hell|the heck|did you do|have you done)\b",
    ),
    _rule(
        "you_undid_my_work",
        2,
        r"\byou(?: just| have|'ve| also)? (?:deleted|removed|dropped|lost|overwrote|overwritten"
        r"|reformatted|renamed|changed|ignored|missed|forgot|skipped|hardcoded|wiped|erased"
        r"|undid|rewrote|rewritten)\b"
        r"|\bwhy (?:did|would|do|are|have|'d) you (?:\w+ )?(?:delete|remov|chang|renam|touch"
        r"|drop|break|broke|rewr|reformat|modif|mov|replac|hardcod|ignor|get rid|undo|undid"
        r"|revert)\w*"
        r"|\b(?:stop|quit) (?:changing|adding|removing|deleting|touching|renaming|rewriting"
        r"|reformatting|breaking|ignoring)\b",
    ),
    _rule(
        "leading_no",
        2,
        r"\A\s*(?:(?:hmm+|um+|uh+|well|ok|okay)[,.]?\s+)?(?:(?:no+|nope|nah|wrong|incorrect)"
        r"(?:\s*[,.!;:-]|\s+(?:no|again)\b|\s*$)|(?:nope|nah)\b|not (?:quite|really)\b)",
        unless_after=r"^\s*(?:problem|worries|need|rush|thanks|thank|that'?s (?:all|it|fine|ok"
        r"|okay|good|everything|enough)|it'?s (?:fine|ok|okay|good)|all good|looks good)",
    ),
    _rule(
        "i_get_an_error",
        3,
        r"\bi(?:'m)? (?:now |still )?(?:get|getting|see|seeing|got|hit|hitting)"
        r" (?:a |an |the |this |that )?(?:new |weird |different )?(?:\w+ )?"
        r"(?:error|exception|crash|traceback|segfault|panic|[45]\d\d)\b",
        unless_before=_CONDITION_EN + r"|\bhow\b",
    ),
    _rule(
        "one_word_complaint",
        3,
        r"\A\s*(?:same|broken|still broken|fail(?:ed|s|ing)?|wrong|incorrect|not working"
        r"|doesn'?t work|nothing|no change)\W*\Z",
    ),
    _rule("dont_touch", 1, r"\bdon'?t (?:touch|delete|remove|rename|modify|reformat)\b"),
    _rule("exasperation", 1, r"\bugh+\b|\bseriously\b|\bcome on\b|\bsigh\b|[?!]{2,}"),
    # Chinese.
    _rule("zh_wrong", 3, r"(?<!对)不对(?!称|外)"),
    _rule(
        "zh_mistake",
        3,
        r"(?<![没不报出])(?:错了|改错|写错|搞错|弄错|理解错|又错)",
        unless_before=r"(?:我自己|是我|我这边|我的问题|我说|我写|我配置|我弄|我搞)",
    ),
    _rule(
        "zh_error",
        3,
        r"报错|出错|报异常|异常了|抛异常",
        unless_before=r"(?:没|不|没有|别|无|如何|怎么|怎样|如果|若|万一)\s*$",
        unless_after=r"^\s*(?:信息|日志|处理|码|提示|的时候|时|的话)"
        r"|^[^,.!?;\n]{0,6}(?:修好|解决|没了|消失|好了|搞定|修复|不见)",
    ),
    _rule(
        "zh_no_good",
        3,
        r"(?<!行)不行(?!的话|吗)|没用(?![到过上的])|没有?(?:效果|反应|变化|解决|修好)|不起作用|不管用",
        unless_before=_CONDITION_ZH,
    ),
    _rule(
        "zh_still",
        3,
        r"(?:还是|仍然|依然|照样)(?!不错)(?:一样|不|没|报错|出错|错|失败|有问题|有\s*bug|挂|崩|卡|慢|空"
        r"|重复|乱码|超时|老样子)|(?:问题|错误|bug|报错)(?:还|依然|仍然)在|还有问题"
        r"|(?:逻辑|结果|输出|代码|这里|这样|数据|页面)(?:还是|又|都)?有(?:问题|\s*bug)(?![吗吧?])"
        r"|(?:输出|结果|页面|返回值?|列表|数据)(?:还是|又|都)?是?(?:空的|空白|为空)",
        unless_before=_CONDITION_ZH,
    ),
    _rule(
        "zh_fails",
        3,
        r"(?:编译|构建|部署|运行|启动|测试|安装|打包|执行|上传|登录|单测|用例)(?:又|还是|都|也|直接)?"
        r"(?:失败|出错|挂了|不过|没过|崩了)|失败了(?:[,.!?]|$)",
        unless_before=_CONDITION_ZH,
        unless_after=_CONDITION_ZH_AFTER,
    ),
    _rule(
        "zh_cannot_run",
        3,
        r"(?:跑|运行|启动|编译|打开|登录|加载|用)(?:都|也|就)?不(?:通|了|起来|过|动|上)|不能用|没法用"
        r"|进不去|打不开|白屏|卡住|卡死|死循环|崩了|挂了|崩溃|闪退",
        unless_before=_CONDITION_ZH,
        unless_after=_CONDITION_ZH_AFTER,
    ),
    _rule(
        "zh_not_what_asked",
        3,
        r"不是(?:我要的|我想要的|这个意思|我说的|我想的|这样)|没(?:看懂|理解|明白)我|我说的是"
        r"|我要的不是|我(?:都|已经)?说了|跟你说了|说了(?:多少|几)(?:次|遍)|不是让你",
    ),
    _rule(
        "zh_made_worse",
        3,
        r"改坏|搞坏|弄坏|搞挂|改崩|改乱|搞乱|更(?:慢|差|糟)|变(?:慢|差)了|越改越",
    ),
    _rule(
        "zh_revert",
        3,
        r"(?:撤销|撤回|回滚|回退|还原|恢复)(?:一下|吧|掉|回去|回来|刚才|刚刚|之前|上一|你的|修改|改动"
        r"|到原来|到之前|成原来|原来|$|[,.!])"
        r"|(?:还是|不如)(?:原来|之前)的?(?:好|版本)|(?:原来|之前)的更好|还不如(?:原来|之前|不改)",
        unless_before=r"(?:不用|不要|别|无需|不需要|如何|怎么|怎样|没必要)",
    ),
    _rule(
        "zh_made_up",
        3,
        r"你编的|瞎编|胡编|(?<!如果)不存在",
        unless_before=_CONDITION_ZH,
        unless_after=_CONDITION_ZH_AFTER,
    ),
    _rule("zh_frustration", 3, r"你这改的|改的(?:啥|什么)|什么鬼|搞什么|啥玩意|怎么回事|怎么又"),
    _rule(
        "zh_you_deleted",
        2,
        r"(?:你|为什么|为啥|怎么)[^,.!?;\n]{0,10}(?:删了|删掉了|删除了|去掉了|改掉了|覆盖了)",
    ),
    _rule("zh_missed_case", 1, r"没有?(?:处理|考虑)"),
)

PRAISE_RULES: tuple[Rule, ...] = (
    _rule(
        "thanks",
        -1,
        r"\b(?:thanks|thank you|thx|ty|cheers)\b|谢谢|多谢|感谢",
        unless_before=r"\bno\s*$",
    ),
    _rule(
        "praise",
        -1,
        r"\b(?:great|perfect|awesome|nice|excellent|sweet|lgtm|brilliant)\b"
        r"|\b(?:looks|look|looking) (?:good|great|right|fine)\b"
        r"|\b(?:works|working) (?:now|great|fine|perfectly)\b|\bthat (?:fixed|did) it\b"
        r"|\ball good\b|\bpasses now\b|\bexactly what\b|\bgood catch\b|\byou were right\b"
        r"|\bthat'?s right\b|完美|搞定|不错|没问题|跑通了|通过了|就对了|好用",
        unless_before=r"(?:n'?t|\bnot|\bnever|\bno|\bhardly)\s+$",
    ),
)


def _normalise(message: str) -> str:
    if len(message) > 2 * PROSE_WINDOW:
        message = message[:PROSE_WINDOW] + "\n" + message[-PROSE_WINDOW:]
    text = unicodedata.normalize("NFKC", message).lower()
    return text.replace("\u2019", "'").replace("\u2018", "'")


def _clause_around(text: str, start: int, end: int) -> tuple[str, str]:
    """The text of the match's clause before and after it."""
    clause_start = max(text.rfind(mark, 0, start) for mark in _CLAUSE_BREAKS) + 1
    ends = [i for mark in _CLAUSE_BREAKS if (i := text.find(mark, end)) >= 0]
    return text[clause_start:start], text[end : min(ends, default=len(text))]


def _apply(rule: Rule, text: str) -> Hit | None:
    suppressed: Hit | None = None
    for match in rule.pattern.finditer(text):
        before, after = _clause_around(text, match.start(), match.end())
        cue = (rule.unless_before and rule.unless_before.search(before)) or (
            rule.unless_after and rule.unless_after.search(after)
        )
        if not cue:
            return Hit(rule.name, rule.weight, match.group().strip())
        if suppressed is None:
            suppressed = Hit(rule.name, 0, match.group().strip(), cue.group().strip())
    return suppressed


def hits(message: str) -> list[Hit]:
    """Every rule that matched the message, suppressed matches included with weight 0."""
    text = _normalise(message)
    found = [hit for rule in TOOL_OUTPUT_RULES if (hit := _apply(rule, message))]
    found += [hit for rule in PHRASE_RULES if (hit := _apply(rule, text))]
    contrast = _CONTRAST.search(text)
    for rule in PRAISE_RULES:
        hit = _apply(rule, text)
        if hit and hit.weight and contrast:
            hit = Hit(hit.rule, 0, hit.text, contrast.group())
        if hit:
            found.append(hit)
    return found


def score(message: str) -> int:
    """The sum of the weights of the rules that fired."""
    return sum(hit.weight for hit in hits(message))


def is_dissatisfied(message: str) -> bool:
    """Whether the follow-up complains about the assistant's last answer."""
    return score(message) >= THRESHOLD


def explain(message: str) -> list[str]:
    """The rules that fired on the message, with their weights and matched text."""
    lines = []
    for hit in hits(message):
        text = hit.text if len(hit.text) <= 60 else hit.text[:57] + "..."
        if hit.suppressed_by is None:
            lines.append(f"{hit.rule} {hit.weight:+d}: {text!r}")
        else:
            lines.append(f"{hit.rule} suppressed by {hit.suppressed_by!r}: {text!r}")
    return lines
