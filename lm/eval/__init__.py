"""Evaluation: held-out bits per byte per set (`sets`), multiple choice by log-likelihood
(`choice`), generation tasks (`generation`), all scored by `loglik.Scorer` and the KV-cache
sampler; task specs (`tasks`), the JSON report and bootstrap comparison (`report`), `lm eval`
(`cli`), sets scored during training (`during`), n-gram contamination (`contamination`), and the
lm-evaluation-harness adapter (`harness`)."""
