"""in_fresh_process: the test body runs once, in a child pytest, and the parent passes only if the child did."""

import os

from isolation import in_fresh_process


def test_the_body_runs_in_a_child_process(request):
    if not in_fresh_process(request):
        return  # the child ran the body below and passed (a failing or missing child fails the parent's assert)
    assert os.environ["PERFKIT_TEST_FRESH_PROCESS"] == request.node.nodeid
