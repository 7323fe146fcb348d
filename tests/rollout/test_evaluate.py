from asyncrl.rollout.evaluate import pass_at_k


def test_pass_at_k():
    assert pass_at_k([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.0]]) == 0.5
    assert pass_at_k([[0.5]], threshold=0.5) == 1.0
    assert pass_at_k([]) == 0.0
