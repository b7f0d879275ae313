"""Boot an engine in a fresh process, run a fixed set of greedy chat requests, print one JSON line:
{"report": <startup report>, "outputs": [{"prompt_token_ids", "output_token_ids"}]}.

Usage: python -m tests.boot_probe '<EngineConfig fields as JSON>' [number of chat requests]
Scenario tests (plans, weight daemon) compare these across restarts."""
import json
import sys

from warmstart.startup.steps import StepTimer

TIMER = StepTimer.from_process_start()

QUESTIONS = ["What is the capital of France?", "Say hello.", "Count to five.", "Name a colour.",
             "Why is the sky blue?", "Write a haiku.", "What is 2+2?", "Tell me a fact."]


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from warmstart.llm import LLM
    from warmstart.sampling_params import SamplingParams
    kw = json.loads(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    llm = LLM(kw.pop("model"), timer=TIMER, **kw)
    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}] for i in range(n)]
    outs = llm.chat(convs, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) if n else []
    print(json.dumps({"report": llm.report.to_dict(),
                      "outputs": [{"prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.output_token_ids}
                                  for o in outs]}))


if __name__ == "__main__":
    main()
