import pytest

from sddoctor.instrument.faults import FaultSpecError, faults_from_env, parse_faults


def test_parse_several_faults():
    faults = parse_faults("skip:rank=1,seq=12; oom:rank=*,step=3,phase=backward;sleep:rank=0|2,seconds=0.5")
    assert [f.kind for f in faults] == ["skip", "oom", "sleep"]
    assert faults[0].applies_to(1) and not faults[0].applies_to(0)
    assert faults[0].get("seq") == 12
    assert faults[1].ranks is None and faults[1].applies_to(7)
    assert faults[1].get("phase") == "backward"
    assert faults[2].ranks == {0, 2} and faults[2].get("seconds") == 0.5


def test_empty_means_no_faults():
    assert parse_faults("") == [] and parse_faults(None) == [] and faults_from_env({}) == []


@pytest.mark.parametrize(
    "spec, words",
    [
        ("explode:rank=1", "unknown fault kind"),
        ("skip", "no parameters"),
        ("skip:rank=1", "lacks seq"),
        ("skip:rank=x,seq=1", "rank='x'"),
        ("skip:rank=1,seq=abc", "not an integer"),
        ("oom:rank=1,step=2,phase=sideways", "valid phases"),
        ("kill:rank=1", "needs step=S or seq=K"),
        ("skip:rank=1,seq=2,color=red", "does not take 'color'"),
        ("skip:rank=1,seq", "not key=value"),
        ("sleep:rank=1,seconds=-1", "finite number >= 0"),
        ("sleep:rank=1,seconds=nan", "finite number >= 0"),
        ("sleep:rank=1,seconds=inf", "finite number >= 0"),
        ("sleep:rank=1,seconds=1,every=0", "every='0'.*1 or more"),
        ("skip:rank=1,seq=0", "seq='0'.*counts from 1"),
        ("kill:rank=1,step=-1", "step='-1'.*must not be negative"),
        ("kill:rank=1,step=2,signal=999", "signal='999'.*not a signal of this system"),
        ("kill:rank=1,step=2,signal=0", "not a signal"),
        ("kill:rank=1,step=2,signal=SIGNOPE", "not a signal"),
        ("oom:rank=1,step=2,times=0", "times='0'"),
        ("skip:rank=1,seq=2,seq=3", "given twice"),
        ("skip:rank=-1,seq=2", "must not be negative"),
    ],
)
def test_malformed_specs_are_errors_that_say_why(spec, words):
    with pytest.raises(FaultSpecError, match=words):
        parse_faults(spec)


def test_every_error_ends_with_the_grammar():
    with pytest.raises(FaultSpecError) as info:
        parse_faults("sleep:rank=1,seconds=nan")
    text = str(info.value)
    assert text.splitlines()[0] == info.value.problem
    assert "SDDOCTOR_FAULT grammar" in text and "skip:rank=R,seq=K" in text


@pytest.mark.parametrize(("value", "number"), [("9", 9), ("KILL", 9), ("SIGTERM", 15), ("sigabrt", 6)])
def test_signals_by_number_or_name(value, number):
    (fault,) = parse_faults(f"kill:rank=0,step=1,signal={value}")
    assert fault.get("signal") == number


def test_ranks_outside_the_world_are_errors_once_it_is_known():
    from sddoctor.instrument.faults import check_world

    faults = parse_faults("skip:rank=0|3,seq=2;sleep:rank=*,seconds=1")
    check_world(faults, None)  # not known yet: nothing to say
    check_world(faults, 4)
    with pytest.raises(FaultSpecError, match=r"rank 3 .* outside the world of 2 rank\(s\) \(0-1\)"):
        check_world(faults, 2)
    with pytest.raises(FaultSpecError, match="outside the world"):
        faults_from_env({"SDDOCTOR_FAULT": "kill:rank=2,step=1", "WORLD_SIZE": "2"})
    assert len(faults_from_env({"SDDOCTOR_FAULT": "kill:rank=1,step=1", "WORLD_SIZE": "2"})) == 1
