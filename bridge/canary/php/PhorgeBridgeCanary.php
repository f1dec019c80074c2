<?php

/**
 * phorge-bridge: the canary's weights, as PHP reads them.
 *
 * Two config options, kept in Phorge's config table (config_entry) and defined
 * by PhorgeBridgeCanaryConfigOptions.php:
 *
 *   - phorge-bridge.canary: the operator's weights per task class and level,
 *     set with "./bin/config set --database phorge-bridge.canary '{...}'";
 *   - phorge-bridge.canary-state: written by the bridge alone (rollbacks and
 *     ramp steps).
 *
 * A weight is the share of a class's tasks the NEW side of a level runs: at
 * the "celery" level the bridge's Celery workers (the old side being phd, here
 * the shipped PhorgeBridgeQueueDaemon), at the "python" level a native handler
 * inside the bridge. Which task goes where is a hash of its id that PHP, Python and
 * SQL compute alike (bucket()), so the daemon and the bridge agree on every
 * row without talking to each other. This class mirrors the bridge's Python
 * (bridge/canary/weights.py): keep them in step.
 *
 * The options are read from the table itself, not through PhabricatorEnv (a
 * process reads its configuration once), at most once a second: a rollback the
 * bridge writes reaches a running daemon within about a second. It fails
 * closed: while the table can not be read, no task of a shared class runs on
 * the new side (newClosed()); a bad value is logged once and the last good one
 * stays in force. Before any good read there are no weights, so the shipped
 * daemon leases nothing, as the bridge leases nothing then.
 *
 * Installed with the other extension files by "phorge-bridge phorge
 * install-extension"; do not edit the installed copy. Written for PHP 7.2
 * (Phorge's minimum).
 */
if (!class_exists('PhorgeBridgeCanary', false)) {

/**
 * A value of phorge-bridge.canary or phorge-bridge.canary-state that is not
 * one; the message names the option and, for a weight, the class.
 */
final class PhorgeBridgeCanaryConfigException extends Exception {}

final class PhorgeBridgeCanary {

  const OPTION = 'phorge-bridge.canary';
  const STATE_OPTION = 'phorge-bridge.canary-state';
  // The bridge's BRIDGE_OWNER_PREFIX: its beat lock's name holds it.
  const OWNER_PREFIX_OPTION = 'phorge-bridge.owner-prefix';

  const LEVEL_CELERY = 'celery';
  const LEVEL_PYTHON = 'python';

  // The key of the weights of every class not named (0 or 100 only).
  const DEFAULT_CLASS = '*';

  // Weights in basis points: 0.01% steps.
  const SCALE = 10000;
  const DEFAULT_DWELL = 600;

  // Seconds a read of the options is used before reading them again.
  const REFRESH_SECONDS = 1.0;

  /**
   * Configured weights, per class: array('celery' => bp, 'python' => bp,
   * 'ramp' => null or array('level' => ..., 'steps' => list of bp, 'dwell'
   * => seconds)).
   */
  private $weights = array();

  /**
   * The bridge's state, per class and level: array('rolledBack' => bool,
   * 'step' => int).
   */
  private $state = array();

  // The reader: when the options were last read, the raw JSON last accepted
  // and the raw JSON whose problem was last logged, per option.
  private $readAt = null;
  private $accepted = array();
  private $rejected = array();

  // Whether the last read of the config table failed (refresh()).
  private $unreadable = false;


/* -(  The choice  )--------------------------------------------------------- */


  /**
   * The task's place in 0..9999 at a level: crc32("level:id") % 10000, as the
   * bridge's Python (zlib.crc32) and SQL (CRC32(CONCAT('celery:', id))).
   */
  public static function bucket($level, $task_id) {
    $crc = crc32($level.':'.$task_id);
    if ($crc < 0) {
      // 32-bit PHP: crc32() is signed there.
      $crc += 4294967296;
    }
    return (int)fmod($crc, self::SCALE);
  }

  /**
   * The canary the two options' values (decoded JSON, null when unset) make;
   * throws PhorgeBridgeCanaryConfigException for a bad value.
   */
  public static function newFromValues($weights, $state) {
    $canary = new self();
    $canary->weights = self::parseWeights($weights);
    $canary->state = self::parseState($state);
    return $canary;
  }

  /**
   * The share (basis points) of the class's tasks the new side of the level
   * runs: configured (or the "*" default, or 100%), then ramped (the step
   * the bridge reached), then 0 while rolled back.
   */
  public function getWeight($task_class, $level) {
    $state = $this->getLevelState($task_class, $level);
    if ($state['rolledBack']) {
      return 0;
    }
    $configured = $this->getConfigured($task_class);
    $ramp = $configured['ramp'];
    if ($ramp !== null && $ramp['level'] === $level) {
      $steps = $ramp['steps'];
      $step = min($state['step'], count($steps) - 1);
      return $steps[$step];
    }
    return $configured[$level];
  }

  /**
   * Whether the new side of the level runs this task. A row that ever failed
   * (failureTime set: an old-side failure, or a fallback from the new side)
   * stays with the old side, unless the new side takes the whole class.
   */
  public function takes($level, $task_class, $task_id, $failure_time) {
    $weight = $this->getWeight($task_class, $level);
    if ($weight >= self::SCALE) {
      return true;
    }
    if ($weight <= 0 || $failure_time !== null) {
      return false;
    }
    return (self::bucket($level, $task_id) < $weight);
  }

  /**
   * The SQL condition (on worker_activetask's columns, unqualified) true for
   * the rows the OLD side of the celery level runs: the rows phd (the shipped
   * daemon) may lease. Null when it runs none (nothing to lease at all).
   */
  public function newOldSideCondition(AphrontDatabaseConnection $conn) {
    $level = self::LEVEL_CELERY;
    // Classes not named have the "*" weights (no ramp, no state), or 100%.
    $default = self::SCALE;
    if (isset($this->weights[self::DEFAULT_CLASS])) {
      $default = $this->weights[self::DEFAULT_CLASS][$level];
    }

    // Named classes (by the weights or the state), grouped by weight.
    $by_weight = array();
    foreach ($this->getNamedClasses() as $task_class) {
      $by_weight[$this->getWeight($task_class, $level)][] = $task_class;
    }

    $none = array();
    $all = array();
    $shared = array();
    foreach ($by_weight as $weight => $classes) {
      if ($weight >= self::SCALE) {
        $none = array_merge($none, $classes);
      } else if ($weight <= 0) {
        $all = array_merge($all, $classes);
      } else {
        $shared[$weight] = $classes;
      }
    }

    $parts = array();
    if ($default >= self::SCALE) {
      // Only the classes named below 100% are (partly) phd's.
      if ($all) {
        $parts[] = qsprintf($conn, 'taskClass IN (%Ls)', $all);
      }
      foreach ($shared as $weight => $classes) {
        $parts[] = qsprintf(
          $conn,
          '(taskClass IN (%Ls) AND %Q)',
          $classes,
          self::newOldShareCondition($conn, $level, $weight));
      }
      if (!$parts) {
        return null;
      }
      return qsprintf($conn, '(%LO)', $parts);
    }

    // Everything is phd's but the classes named above 0%.
    if ($none) {
      $parts[] = qsprintf($conn, 'taskClass NOT IN (%Ls)', $none);
    }
    foreach ($shared as $weight => $classes) {
      $parts[] = qsprintf(
        $conn,
        '(taskClass NOT IN (%Ls) OR %Q)',
        $classes,
        self::newOldShareCondition($conn, $level, $weight));
    }
    if (!$parts) {
      return qsprintf($conn, '1 = 1');
    }
    return qsprintf($conn, '(%LA)', $parts);
  }

  // The old side's rows of a class shared at $weight: the sticky ones (that
  // ever failed or fell back) and those whose bucket is at or above the weight.
  private static function newOldShareCondition(
    AphrontDatabaseConnection $conn,
    $level,
    $weight) {

    return qsprintf(
      $conn,
      '(failureTime IS NOT NULL OR MOD(CRC32(CONCAT(%s, id)), %d) >= %d)',
      $level.':',
      self::SCALE,
      $weight);
  }

  /**
   * Whether the weights leave phd any task at the celery level: a class
   * named below 100 (or rolled back), or every class not named.
   */
  public function givesPhdAShare() {
    if (isset($this->weights[self::DEFAULT_CLASS]) &&
        $this->weights[self::DEFAULT_CLASS][self::LEVEL_CELERY] < self::SCALE) {
      return true;
    }
    foreach ($this->getNamedClasses() as $task_class) {
      if ($this->getWeight($task_class, self::LEVEL_CELERY) < self::SCALE) {
        return true;
      }
    }
    return false;
  }

  /**
   * The classes the weights or the state name (the "*" default aside).
   */
  public function getNamedClasses() {
    $names = array();
    foreach ($this->weights as $name => $ignored) {
      if ((string)$name !== self::DEFAULT_CLASS) {
        $names[(string)$name] = true;
      }
    }
    foreach ($this->state as $name => $ignored) {
      $names[(string)$name] = true;
    }
    $names = array_keys($names);
    sort($names, SORT_STRING);
    return $names;
  }

  private function getConfigured($task_class) {
    if (isset($this->weights[$task_class])) {
      return $this->weights[$task_class];
    }
    if (isset($this->weights[self::DEFAULT_CLASS])) {
      return $this->weights[self::DEFAULT_CLASS];
    }
    return self::newClassWeights();
  }

  private function getLevelState($task_class, $level) {
    if (isset($this->state[$task_class][$level])) {
      return $this->state[$task_class][$level];
    }
    return array('rolledBack' => false, 'step' => 0);
  }

  private static function newClassWeights() {
    return array(
      self::LEVEL_CELERY => self::SCALE,
      self::LEVEL_PYTHON => self::SCALE,
      'ramp' => null,
    );
  }


/* -(  Reading the options  )------------------------------------------------ */


  /**
   * The canary in force, re-read from the config table if the last read is
   * older than a second. Never throws. It fails closed: while the table can
   * not be read, the last good values run as newClosed() says (logged once);
   * a bad value is logged once and the last good one stays.
   */
  public function refresh() {
    $now = microtime(true);
    if ($this->readAt !== null &&
        $now >= $this->readAt &&
        $now - $this->readAt < self::REFRESH_SECONDS) {
      return $this->getInForce();
    }
    $this->readAt = $now;

    try {
      $raw = self::readOptions();
    } catch (Throwable $ex) {
      if (!$this->unreadable) {
        phlog(
          new Exception(
            pht(
              'phorge-bridge: can not read "%s" from the config table; no '.
              'task of a shared class runs on the new side until it is read '.
              'again.',
              self::OPTION),
            0,
            $ex));
      }
      $this->unreadable = true;
      return $this->getInForce();
    }

    $this->unreadable = false;
    $this->accept(self::OPTION, idx($raw, self::OPTION));
    $this->accept(self::STATE_OPTION, idx($raw, self::STATE_OPTION));
    return $this;
  }

  private function getInForce() {
    return $this->unreadable ? $this->newClosed() : $this;
  }

  /**
   * This canary as it runs while the options can not be read: the new side of
   * every class shared at a level (0 < weight < 100, a ramp's step included)
   * runs none of it there; classes wholly on one side, and rollbacks, stay as
   * they were. The bridge's Canary.closed() is its twin.
   */
  public function newClosed() {
    $closed = new self();
    $closed->state = $this->state;
    foreach ($this->weights as $name => $ignored) {
      $entry = array('ramp' => null);
      foreach (array(self::LEVEL_CELERY, self::LEVEL_PYTHON) as $level) {
        $weight = $this->getWeight((string)$name, $level);
        $shared = ($weight > 0 && $weight < self::SCALE);
        $entry[$level] = $shared ? 0 : $weight;
      }
      $closed->weights[$name] = $entry;
    }
    return $closed;
  }

  private function accept($option, $raw) {
    $key = ($raw === null) ? null : (string)$raw;
    if (array_key_exists($option, $this->accepted) &&
        $this->accepted[$option] === $key) {
      return;
    }

    try {
      $value = self::decodeValue($option, $key);
      if ($option === self::OPTION) {
        $this->weights = self::parseWeights($value);
      } else {
        $this->state = self::parseState($value);
      }
    } catch (PhorgeBridgeCanaryConfigException $ex) {
      if (!array_key_exists($option, $this->rejected) ||
          $this->rejected[$option] !== $key) {
        $this->rejected[$option] = $key;
        phlog(
          pht(
            'phorge-bridge: ignoring the value of "%s" (%s); the last good '.
            'value stays in force.',
            $option,
            $ex->getMessage()));
      }
      return;
    }

    $this->accepted[$option] = $key;
    unset($this->rejected[$option]);
  }

  /**
   * The two options' raw JSON as the config table holds them (an option not
   * set, or deleted, is absent), read on the write connection: a replica
   * could lag behind a rollback.
   */
  public static function readOptions() {
    $table = new PhabricatorConfigEntry();
    $conn = $table->establishConnection('w');
    $rows = queryfx_all(
      $conn,
      'SELECT configKey, value FROM %T
        WHERE namespace = %s AND configKey IN (%Ls) AND isDeleted = 0',
      $table->getTableName(),
      'default',
      array(self::OPTION, self::STATE_OPTION));
    return ipull($rows, 'value', 'configKey');
  }

  private static function decodeValue($option, $raw) {
    if ($raw === null) {
      return null;
    }
    $value = json_decode($raw, true);
    if ($value === null && json_last_error() !== JSON_ERROR_NONE) {
      throw new PhorgeBridgeCanaryConfigException(
        pht('%s: not JSON: %s', $option, json_last_error_msg()));
    }
    return $value;
  }


/* -(  Parsing the values  )------------------------------------------------- */


  /**
   * phorge-bridge.canary's value (decoded JSON; null or an empty array when
   * unset) as weights per class, checked as the bridge checks them.
   */
  public static function parseWeights($value) {
    if ($value === null || $value === array()) {
      return array();
    }
    if (!is_array($value) || self::isList($value)) {
      throw self::newWeightsException(
        pht(
          'expected a JSON object of task classes, got %s',
          self::describe($value)));
    }
    $default = self::newClassWeights();
    if (array_key_exists(self::DEFAULT_CLASS, $value)) {
      $default = self::parseClassWeights(
        self::DEFAULT_CLASS,
        $value[self::DEFAULT_CLASS],
        $default);
    }
    $weights = array();
    foreach ($value as $name => $entry) {
      $name = (string)$name;
      if ($name === self::DEFAULT_CLASS) {
        $weights[$name] = $default;
      } else {
        $weights[$name] = self::parseClassWeights($name, $entry, $default);
      }
    }
    return $weights;
  }

  // A class's entry; a level it leaves out has the "*" entry's weight (100
  // without one), but for a ramp's own level: naming a class at one level
  // moves it at no other.
  private static function parseClassWeights($name, $value, array $default) {
    $known = array(self::LEVEL_CELERY, self::LEVEL_PYTHON, 'ramp', 'guard');
    if (!self::isObject($value) || array_diff(array_keys($value), $known)) {
      throw self::newWeightsException(
        pht(
          '%s: expected an object with celery, python, ramp or guard, got %s',
          $name,
          self::describe($value)));
    }

    $levels = array(self::LEVEL_CELERY, self::LEVEL_PYTHON);
    $given = array();
    foreach ($levels as $level) {
      if (array_key_exists($level, $value)) {
        $given[$level] = self::parsePercent(
          $value[$level],
          $name.'.'.$level,
          false);
      }
    }
    $ramp = null;
    if (array_key_exists('ramp', $value)) {
      $ramp = self::parseRamp($name, $value['ramp']);
    }
    if ($ramp !== null &&
        idx($given, $ramp['level'], self::SCALE) !== self::SCALE) {
      throw self::newWeightsException(
        pht('%s: a ramp sets the %s weight itself', $name, $ramp['level']));
    }

    $weights = array('ramp' => $ramp, 'guard' => array());
    if (array_key_exists('guard', $value)) {
      $weights['guard'] = self::parseGuard($name, $value['guard']);
    }
    $shared = array();
    foreach ($levels as $level) {
      if (array_key_exists($level, $given)) {
        $weights[$level] = $given[$level];
      } else if ($ramp !== null && $ramp['level'] === $level) {
        $weights[$level] = self::SCALE;
      } else {
        $weights[$level] = $default[$level];
      }
      if ($weights[$level] > 0 && $weights[$level] < self::SCALE) {
        $shared[$level] = true;
      }
    }
    if ($ramp !== null) {
      $shared[$ramp['level']] = true;
    }
    if (count($shared) > 1) {
      throw self::newWeightsException(
        pht('%s: only one level may be shared at a time', $name));
    }

    if ($name === self::DEFAULT_CLASS) {
      $whole = array(0, self::SCALE);
      if ($ramp !== null ||
          array_key_exists('guard', $value) ||
          !in_array($weights[self::LEVEL_CELERY], $whole, true) ||
          !in_array($weights[self::LEVEL_PYTHON], $whole, true)) {
        throw self::newWeightsException(
          pht(
            '%s: the default weights are 0 or 100, without a ramp or guard',
            self::DEFAULT_CLASS));
      }
    }

    return $weights;
  }

  // A class's own bounds for the bridge's guard (it alone reads them), checked
  // as the bridge checks them: each as its BRIDGE_CANARY_* setting.
  private static function parseGuard($name, $value) {
    $bounds = array(
      'min_runs' => 'a positive integer',
      'min_failures' => 'a positive integer',
      'failure_limit' => 'a positive integer',
      'max_drop' => 'a number from 0 to 1',
      'significance' => 'a number between 0 and 1 (exclusive)',
      'max_slowdown' => 'a number of at least 1',
      'slowdown_floor' => 'a positive number of seconds',
      'max_followup_change' => 'a number from 0 to 1',
      'max_yielding' => 'a positive integer of seconds',
    );
    if (!self::isObject($value) ||
        array_diff(array_keys($value), array_keys($bounds))) {
      throw self::newWeightsException(
        pht(
          '%s.guard: expected an object of %s, got %s',
          $name,
          implode(', ', array_keys($bounds)),
          self::describe($value)));
    }
    foreach ($value as $key => $bound) {
      if (!self::isGuardBound($key, $bound)) {
        throw self::newWeightsException(
          pht(
            '%s.guard.%s: expected %s, got %s',
            $name,
            $key,
            $bounds[$key],
            self::describe($bound)));
      }
    }
    return $value;
  }

  private static function isGuardBound($key, $value) {
    $number = (is_int($value) || is_float($value)) && is_finite((float)$value);
    switch ($key) {
      case 'min_runs':
      case 'min_failures':
      case 'failure_limit':
      case 'max_yielding':
        return is_int($value) && $value >= 1;
      case 'max_drop':
      case 'max_followup_change':
        return $number && $value >= 0 && $value <= 1;
      case 'significance':
        return $number && $value > 0 && $value < 1;
      case 'max_slowdown':
        return $number && $value >= 1;
      case 'slowdown_floor':
        return $number && $value > 0;
    }
    return false;
  }

  private static function parseRamp($name, $value) {
    $where = $name.'.ramp';
    if (!self::isObject($value) ||
        array_diff(array_keys($value), array('level', 'steps', 'dwell'))) {
      throw self::newWeightsException(
        pht(
          '%s: expected {level, steps, dwell}, got %s',
          $where,
          self::describe($value)));
    }

    $level = idx($value, 'level');
    if ($level !== self::LEVEL_CELERY && $level !== self::LEVEL_PYTHON) {
      throw self::newWeightsException(
        pht(
          '%s.level: expected celery or python, got %s',
          $where,
          self::describe($level)));
    }

    $steps = idx($value, 'steps');
    if (!is_array($steps) || !$steps || !self::isList($steps)) {
      throw self::newWeightsException(
        pht('%s.steps: expected a list of percentages', $where));
    }
    $points = array();
    foreach ($steps as $step) {
      $points[] = self::parsePercent($step, $where.'.steps', true);
    }
    $rising = array_values(array_unique($points));
    sort($rising);
    if ($rising !== $points) {
      throw self::newWeightsException(
        pht('%s.steps: must rise, got %s', $where, self::describe($steps)));
    }

    $dwell = idx($value, 'dwell', self::DEFAULT_DWELL);
    if (!is_int($dwell) || $dwell <= 0) {
      throw self::newWeightsException(
        pht(
          '%s.dwell: expected seconds > 0, got %s',
          $where,
          self::describe($dwell)));
    }

    return array('level' => $level, 'steps' => $points, 'dwell' => $dwell);
  }

  // A percentage (0..100, or (0..100] for a ramp step) in basis points,
  // rounded as the bridge rounds it.
  private static function parsePercent($value, $where, $low_open) {
    if (!(is_int($value) || is_float($value)) || !is_finite((float)$value)) {
      throw self::newWeightsException(
        pht('%s: expected a percentage, got %s', $where, self::describe($value)));
    }
    $inside = $low_open ?
      ($value > 0 && $value <= 100) :
      ($value >= 0 && $value <= 100);
    if (!$inside) {
      throw self::newWeightsException(
        pht(
          '%s: %s is outside %s, 100]',
          $where,
          self::describe($value),
          $low_open ? '(0' : '[0'));
    }
    return self::roundHalfEven($value * self::SCALE / 100);
  }

  // Python's round() of a float: the nearest integer, a tie to the even one,
  // of the exact binary value (PHP's round() pre-rounds, so it can differ).
  private static function roundHalfEven($value) {
    $floor = floor($value);
    $fraction = $value - $floor;
    if ($fraction > 0.5) {
      return (int)$floor + 1;
    }
    if ($fraction < 0.5) {
      return (int)$floor;
    }
    return ((int)$floor % 2 === 0) ? (int)$floor : (int)$floor + 1;
  }

  /**
   * phorge-bridge.canary-state's value (decoded JSON; null or an empty array
   * when unset): per class and level, whether it is rolled back (its
   * "rolled_back" has an "at") and the ramp step reached (an integer from 0).
   * Anything else the bridge does not write is refused, as the bridge refuses
   * it. The history is the bridge's to read.
   */
  public static function parseState($value) {
    if ($value === null || $value === array()) {
      return array();
    }
    if (!is_array($value) || self::isList($value)) {
      throw self::newStateException($value);
    }
    $classes = idx($value, 'classes', array());
    if (!self::isObject($classes)) {
      throw self::newStateException($value);
    }
    $history = idx($value, 'history', array());
    if (!is_array($history) || ($history && !self::isList($history))) {
      throw self::newStateException($value);
    }
    foreach ($history as $event) {
      $fields = array('at', 'class', 'level', 'event', 'weight');
      if (!is_array($event) ||
          count(array_intersect_key($event, array_fuse($fields))) !== 5) {
        throw self::newStateException($value);
      }
    }

    $state = array();
    foreach ($classes as $name => $levels) {
      if (!self::isObject($levels)) {
        throw self::newStateException($value);
      }
      foreach ($levels as $level => $entry) {
        if (!self::isObject($entry)) {
          throw self::newStateException($value);
        }
        // As the bridge reads it: rolled back once "rolled_back" has an "at".
        $rolled_back = idx($entry, 'rolled_back');
        if ($rolled_back !== null && !self::isObject($rolled_back)) {
          throw self::newStateException($value);
        }
        $step = idx($entry, 'step', 0);
        if (!is_int($step) || $step < 0) {
          throw self::newStateException($value);
        }
        $state[(string)$name][(string)$level] = array(
          'rolledBack' =>
            ($rolled_back !== null && idx($rolled_back, 'at') !== null),
          'step' => $step,
        );
      }
    }
    return $state;
  }

  private static function isList(array $value) {
    return ($value === array() ||
      array_keys($value) === range(0, count($value) - 1));
  }

  // A JSON object once json_decode($raw, true) has read it: an array that is
  // not a list, or array() (json_encode() writes {} as [], so both are one).
  private static function isObject($value) {
    return (is_array($value) && ($value === array() || !self::isList($value)));
  }

  private static function describe($value) {
    $json = @json_encode($value);
    return ($json === false) ? gettype($value) : $json;
  }

  private static function newWeightsException($problem) {
    return new PhorgeBridgeCanaryConfigException(self::OPTION.': '.$problem);
  }

  private static function newStateException($value) {
    return new PhorgeBridgeCanaryConfigException(
      pht(
        "%s: not the bridge's state: %s",
        self::STATE_OPTION,
        self::describe($value)));
  }

}

}
