<?php

/**
 * phorge-bridge: the canary's config options, so that Phorge's
 * own tools know them ("./bin/config set --database phorge-bridge.canary
 * '{...}'", "./bin/config get", the Config application) and its setup checks
 * do not report them as unknown. How the values are read and what they mean:
 * PhorgeBridgeCanary.php, installed next to this file.
 *
 * Installed by "phorge-bridge phorge install-extension"; do not edit the
 * installed copy. Written for PHP 7.2 (Phorge's minimum).
 */
require_once dirname(__FILE__).'/PhorgeBridgeCanary.php';

final class PhorgeBridgeCanaryConfigOptions
  extends PhabricatorApplicationConfigOptions {

  public function getName() {
    return pht('phorge-bridge Canary');
  }

  public function getDescription() {
    return pht(
      'Which share of each task class phorge-bridge runs, and the state of '.
      'its automatic rollbacks.');
  }

  public function getIcon() {
    return 'fa-random';
  }

  public function getGroup() {
    return 'core';
  }

  public function getKey() {
    return 'phorge-bridge';
  }

  public function getApplicationClassName() {
    return 'PhabricatorDaemonsApplication';
  }

  public function getOptions() {
    $example = array(
      '*' => array('celery' => 0),
      'PhabricatorSearchWorker' => array('celery' => 100),
      'ManiphestTransactionMailWorker' => array('celery' => 5),
      'FeedPublisherHTTPWorker' => array('celery' => 100, 'python' => 50),
      'PhabricatorRepositoryCommitParserWorker' => array(
        'ramp' => array(
          'level' => 'celery',
          'steps' => array(1, 5, 25, 50, 100),
          'dwell' => 600,
        ),
      ),
    );

    return array(
      $this->newOption(PhorgeBridgeCanary::OPTION, 'wild', array())
        ->setSummary(
          pht('Share of each task class that phorge-bridge runs (canary).'))
        ->setDescription(
          pht(
            "Moves Phorge's task queue from phd to phorge-bridge class by ".
            "class. For each task class (or `*`, the default for classes not ".
            "named: 0 or 100 only), the percentage of its tasks the new side ".
            "runs, at one of two levels:\n\n".
            "  - `celery`: phorge-bridge's Celery workers against phd (run ".
            "`PhorgeBridgeQueueDaemon` in place of Phorge's ".
            "taskmasters: it leaves the bridge's share alone);\n".
            "  - `python`: inside the bridge, a native (Python) handler ".
            "against the PHP worker.\n\n".
            "Only one level per class may be shared (between 0 and 100). A ".
            "`ramp` (`level`, rising `steps`, `dwell` seconds, default 600) ".
            "raises the weight step by step while the bridge's guard is ".
            "quiet. A class not named, and a level a class leaves out, has ".
            "the weights of `*` (100 without it). Which ".
            "task goes to which side is a hash of its id; a task that ever ".
            "failed stays with the old side.\n\n".
            "Set it with `bin/config set --database`: running daemons and ".
            "the bridge read it from the database within seconds. See ".
            "phorge-bridge's docs/canary.md."))
        ->addExample(
          id(new PhutilJSON())->encodeFormatted($example),
          pht('Mail to 5%% of the bridge, search wholly, the rest on phd')),
      $this->newOption(
        PhorgeBridgeCanary::OWNER_PREFIX_OPTION,
        'string',
        'bridge')
        ->setSummary(pht("phorge-bridge's BRIDGE_OWNER_PREFIX."))
        ->setDescription(
          pht(
            "The bridge's owner prefix (its BRIDGE_OWNER_PREFIX), by which ".
            "Phorge's setup checks find its beat lock: with the bridge ".
            "running the queue, they warn only when nothing runs it.")),
      $this->newOption(PhorgeBridgeCanary::STATE_OPTION, 'wild', array())
        ->setSummary(
          pht("phorge-bridge's canary state (rollbacks, ramp steps)."))
        ->setDescription(
          pht(
            "Written by phorge-bridge, not by hand: which classes its guard ".
            "rolled back (their weight is 0 until `phorge-bridge canary ".
            "promote CLASS`), the ramp steps reached and their history. ".
            "Read it with `phorge-bridge canary status` or ".
            "`phorge-bridge canary report`.")),
    );
  }

  protected function didValidateOption(
    PhabricatorConfigOption $option,
    $value) {

    try {
      switch ($option->getKey()) {
        case PhorgeBridgeCanary::OPTION:
          PhorgeBridgeCanary::parseWeights($value);
          break;
        case PhorgeBridgeCanary::STATE_OPTION:
          PhorgeBridgeCanary::parseState($value);
          break;
      }
    } catch (PhorgeBridgeCanaryConfigException $ex) {
      throw new PhabricatorConfigValidationException($ex->getMessage());
    }
  }

}
