"""What users call: `DistModel`, `to_static` and `attach` (`model`), `fit` (`fit`), `evaluate`
(`evaluation`), `raydist.status`/`models` (`status`) and the resume record (`resume`). Imports every
package above; nothing imports it but `raydist` itself.
"""
