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
        ("skip:rank=1,seq=abc", "not a int"),
        ("oom:rank=1,step=2,phase=sideways", "valid phases"),
        ("kill:rank=1", "needs step=S or seq=K"),
        ("skip:rank=1,seq=2,color=red", "does not take 'color'"),
        ("skip:rank=1,seq", "not key=value"),
        ("sleep:rank=1,seconds=-1", "must not be negative"),
    ],
)
def test_malformed_specs_are_errors_that_say_why(spec, words):
    with pytest.raises(FaultSpecError, match=words):
        parse_faults(spec)
